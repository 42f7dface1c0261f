#!/usr/bin/env bash
# GPU smoke run: the CUDA test binaries and the CUDA `folio` binary, built on a GPU-less machine,
# run on the GPU machine. Two halves:
#
#   tools/gpu-smoke.sh pack    # here: after `cargo build --workspace --no-default-features
#                              # --features cuda --tests` (with scripts/cuda-toolchain.sh
#                              # sourced), copy the binaries into .gpu/ (ignored by git), stripped;
#                              # FOLIO_PROFILE=release takes `folio` from a `cargo build --release
#                              # -p folio --no-default-features --features cuda` instead
#   tools/gpu-smoke.sh run     # there (device tool, carry [".gpu"]): kernels vs CPU reference,
#                              # every fixture's logits on CUDA vs CPU, and a CUDA chat; log to $OUT
#   tools/gpu-smoke.sh kernels # there: only the hand-written kernels vs their references, and
#                              # `folio bench kernels` (ratio to the limits measured in the run)
#   tools/gpu-smoke.sh tiers   # there: both decode tiers' fast paths vs the CPU references on
#                              # CUDA, then a chat per method on each tier over the samples
#   tools/gpu-smoke.sh quant   # there: the quantized-weight kernels vs their CPU reference, the
#                              # GGUF fixtures' perplexity on CUDA (the decode path in f32 and
#                              # bf16, the batched one: --chunk 16) beside the CPU's, and the
#                              # quantized rows of `folio bench kernels`; log and JSON to $OUT
#   tools/gpu-smoke.sh shape N M     # there: `folio bench --shape` at context N, methods M (hip:2048,…)
#   tools/gpu-smoke.sh prefill S T [KV] # there: `folio bench prefill` of model/shape S, T tokens, 24 GiB cap
#   tools/gpu-smoke.sh peer S T [KV]    # there: the same with --profile, then Hugging Face transformers
#                              # prefilling shape S at T tokens (tools/peer-prefill.py) and the ratio;
#                              # JSON and log to $OUT
#   tools/gpu-smoke.sh compare # there: two builds (.gpu/compare.tar.xz: before/ and after/, each
#                              # packed as `pack` packs) run the same kernel and offload tests and
#                              # the same benchmarks in one sitting; tools/compare_builds.py prints
#                              # both builds' figures and their ratio; JSON and logs to $OUT
#   tools/gpu-smoke.sh onebuild  # there: the one build on a GPU machine: the libraries it needs to
#                              # start, the GPU found with no LD_LIBRARY_PATH, the reason when no
#                              # GPU is visible, the samples answered on the GPU; log to $OUT
#   tools/gpu-smoke.sh needle [L] [N]   # there: the demo model's needle eval, every offloaded method,
#                              # one tar of reports and transformers' checks of the misses
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The demo model's evals (needle, fidelity): $folio (the packed binary, or $FOLIO), a results
# folder $res named $1, and $model, a copy of the demo model (calibration is written next to
# the model: a copy, not assets/).
demo_eval_setup() {
  folio=${FOLIO:-.gpu/folio}
  [ -n "${FOLIO:-}" ] || tar -C .gpu -xJf .gpu/bundle.tar.xz folio
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  res=$(mktemp -d)/$1
  mkdir -p "$res"
  model=$(mktemp -d)/demo
  cp -r assets/models/demo "$model"
}

case "${1:-}" in
  pack)
    target=${CARGO_TARGET_DIR:-$HOME/.cache/folio-target}/debug
    rm -rf .gpu && mkdir -p .gpu
    newest() { ls -t "$target"/deps/"$1"-* | grep -v '\.d$' | head -1; }
    cp "$(newest attention)" .gpu/kernels-attention
    cp "$(newest sparse)" .gpu/kernels-sparse
    cp "$(newest select)" .gpu/kernels-select
    cp "$(newest encode)" .gpu/kernels-encode
    cp "$(newest mlp)" .gpu/kernels-mlp
    cp "$(newest heads)" .gpu/kernels-heads
    cp "$(newest norm)" .gpu/kernels-norm
    cp "$(newest quant)" .gpu/kernels-quant
    cp "$(newest transfer)" .gpu/kernels-transfer
    cp "$(newest hip)" .gpu/method-kernels-hip
    cp "$(newest magicpig)" .gpu/method-kernels-magicpig
    cp "$(newest parity)" .gpu/models-parity
    cp "$(newest context)" .gpu/models-context
    cp "$(newest offload)" .gpu/models-offload
    cp "$target/../${FOLIO_PROFILE:-debug}/folio" .gpu/folio
    strip .gpu/*
    # The binaries embed candle's PTX (text): xz shrinks them ~6x, under the device tool's 64 MiB.
    bins=(folio kernels-attention kernels-sparse kernels-select kernels-encode kernels-mlp kernels-heads kernels-norm kernels-quant kernels-transfer
      method-kernels-hip method-kernels-magicpig models-parity models-context models-offload)
    tar -C .gpu -cf - "${bins[@]}" | xz -T2 -9 > .gpu/bundle.tar.xz
    (cd .gpu && rm "${bins[@]}")
    du -sh .gpu/bundle.tar.xz
    ;;
  run)
    tar -C .gpu -xJf .gpu/bundle.tar.xz
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export FOLIO_FIXTURES=$PWD/tests/fixtures/models
    log=${OUT:-/tmp}/gpu-smoke.log
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "== kernels: fast attention vs reference (CPU and CUDA)"
      .gpu/kernels-attention --test-threads 1
      echo "== models: fixtures on CUDA vs CPU and transformers"
      .gpu/models-parity --test-threads 1 --nocapture cuda_logits_match_cpu
      echo "== folio chat on CUDA (bf16)"
      .gpu/folio chat --model tests/fixtures/models/llama --device cuda --json --temperature 0 --max-tokens 16 \
        --system "You are a helpful assistant." "What is the capital of France?"
      .gpu/folio info --model tests/fixtures/models/qwen3 --device cuda
      echo "== context files on CUDA: prefill on the GPU vs the CPU, a GPU-made file on the CPU"
      .gpu/models-context --test-threads 1 --nocapture cuda_prefill_matches_cpu
      ctx=$(mktemp -d)/samples.folio
      .gpu/folio prefill --model assets/models/demo --device cuda --docs assets/samples --out "$ctx"
      .gpu/folio context info "$ctx" --verify
      .gpu/folio chat --context "$ctx" --device cuda --temperature 0 --max-tokens 16 "what is the secret code of amber falcon ?"
      echo "== folio bench prefill on CUDA (bf16 compute, bf16 K/V)"
      .gpu/folio bench prefill --model assets/models/demo --device cuda --tokens ${BENCH_TOKENS:-8192,32768}
    } 2>&1 | tee "$log"
    ;;
  onebuild)
    tar -C .gpu -xJf .gpu/bundle.tar.xz
    out=${OUT:-/tmp}
    demo=assets/models/demo
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "== the libraries the binary needs to start (no CUDA library among them)"
      (readelf -d .gpu/folio 2>/dev/null || objdump -p .gpu/folio) | grep NEEDED
      echo "== no LD_LIBRARY_PATH: the driver by name, the toolkit's libraries from /usr/local/cuda/lib64"
      env -u LD_LIBRARY_PATH .gpu/folio info --model $demo
      env -u LD_LIBRARY_PATH .gpu/folio info --model $demo --json > "$out/info.json"
      echo "== no GPU visible (CUDA_VISIBLE_DEVICES empty): the CPU, and the reason"
      CUDA_VISIBLE_DEVICES= .gpu/folio info --model $demo
      echo "== --device cuda with no GPU visible: refused with the reason"
      CUDA_VISIBLE_DEVICES= .gpu/folio info --model $demo --device cuda && echo "exit 0 (wrong)" || echo "exit $? (refused)"
      echo "== the samples prefilled and asked with the default device (auto: the GPU)"
      ctx=$(mktemp -d)/samples.folio
      env -u LD_LIBRARY_PATH .gpu/folio prefill --model $demo --docs assets/samples --out "$ctx" --json > "$out/prefill.json"
      env -u LD_LIBRARY_PATH .gpu/folio chat --context "$ctx" --temperature 0 --json \
        "what is the room number of silver otter ?" | tee "$out/chat.json"
    } 2>&1 | tee "$out/one-build.log"
    ;;
  kernels)
    tar -C .gpu -xJf .gpu/bundle.tar.xz
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "== attention kernels (tensor-core prefill included) vs their CPU references"
      .gpu/kernels-attention --test-threads 1 --nocapture
      echo "== fp8 encoding, the MLP activation, RMSNorm, projections to heads and staged host copies vs their CPU references"
      .gpu/kernels-encode --nocapture
      .gpu/kernels-mlp --nocapture
      .gpu/kernels-heads --nocapture
      .gpu/kernels-norm --nocapture
      .gpu/kernels-quant --nocapture
      .gpu/kernels-transfer --nocapture
      echo "== sparse-decode kernels vs their CPU references"
      .gpu/kernels-sparse --test-threads 1 --nocapture
      .gpu/kernels-select --test-threads 1 --nocapture
      echo "== the methods' own kernels (HiP's block search, MagicPIG's sample) vs their references"
      .gpu/method-kernels-hip --test-threads 1 --nocapture
      .gpu/method-kernels-magicpig --test-threads 1 --nocapture
      echo "== the offloaded KV tier's fast paths vs the methods' CPU references"
      .gpu/models-offload --test-threads 1 --nocapture
      echo "== folio bench kernels (Qwen2.5-7B attention shape, 1M-row K/V)"
      .gpu/folio bench kernels --device cuda
    } 2>&1 | tee "${OUT:-/tmp}/gpu-kernels.log"
    ;;
  compare)
    tar -C .gpu -xJf .gpu/compare.tar.xz
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    out=${OUT:-/tmp}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
    for side in before after; do
      d=.gpu/$side
      {
        for t in "$d"/kernels-* "$d"/method-kernels-* "$d"/models-offload; do
          [ -x "$t" ] || continue
          echo "== $(basename "$t")"
          "$t" --test-threads 1 2>&1 | grep -E "^test result|FAILED|panicked" || true
        done
      } > "$out/$side-tests.log" 2>&1
      "$d"/folio bench kernels --device cuda --json > "$out/$side-kernels.json" 2> "$out/$side-kernels.err" || true
      "$d"/folio bench --device cuda --shape assets/shapes/qwen2.5-7b-instruct-1m.json --context "${CONTEXT:-131072}" \
        --method "${METHODS:-dense,hip,magicpig,double-sparsity,buzz,streaming,topk}" --vram-budget 24GiB \
        --steps "${STEPS:-16}" --warmup 4 --json > "$out/$side-shape.jsonl" 2> "$out/$side-shape.err" || true
      "$d"/folio bench prefill --model assets/models/demo --device cpu --tokens 4096 --json \
        > "$out/$side-prefill.json" 2> "$out/$side-prefill.err" || true
    done
    python3 tools/compare_builds.py "$out" | tee "$out/compare.txt"
    ;;
  tiers)
    # The decode tiers (issue #15): every method's fast path, resident and offloaded, against its
    # CPU reference on the GPU (the kernels first), then the samples context asked through the
    # CLI with every method at its default budget, on each tier that runs it.
    tar -C .gpu -xJf .gpu/bundle.tar.xz
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "== kernels vs their CPU references"
      .gpu/kernels-attention --test-threads 1
      .gpu/kernels-sparse --test-threads 1
      .gpu/kernels-select --test-threads 1
      .gpu/method-kernels-hip --test-threads 1
      .gpu/method-kernels-magicpig --test-threads 1
      echo "== every method's fast path on both tiers vs its reference (synthetic, then a demo-model context)"
      .gpu/models-offload --test-threads 1 --nocapture
      .gpu/models-context --test-threads 1 --nocapture offloaded_decode_matches_resident
      echo "== the samples through the CLI, every method at its default budget, both tiers"
      work=$(mktemp -d); cp -r assets/models/demo "$work/model"
      .gpu/folio calibrate --model "$work/model" --device cuda --docs assets/samples --json >/dev/null
      .gpu/folio prefill --model "$work/model" --device cuda --docs assets/samples --out "$work/s.folio" --json >/dev/null
      # Each method on each tier the registry runs it on (`folio methods --json`).
      pairs=$(.gpu/folio methods --json | python3 -c 'import json,sys
for m in json.load(sys.stdin):
    for tier in ("resident", "offloaded"):
        if m[tier]["path"] != "none": print(m["name"], tier)')
      while read -r m tier; do
        flag=(); [ "$tier" = offloaded ] && flag=(--offload)
        printf '%-16s %-9s ' "$m" "$tier"
        .gpu/folio chat --context "$work/s.folio" --device cuda --method "$m" "${flag[@]}" --temperature 0 \
          --max-tokens 12 --json "what is the secret code of amber falcon ?" \
          | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%r  first token %.3f s, %.0f tok/s" % (d["text"], d["first_token_seconds"], d["decode_tokens_per_second"] or 0))'
      done <<< "$pairs"
    } 2>&1 | tee "${OUT:-/tmp}/gpu-tiers.log"
    ;;
  quant)
    [ -f .gpu/bundle.tar.xz ] && tar -C .gpu -xJf .gpu/bundle.tar.xz folio kernels-quant
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    out=${OUT:-/tmp}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "== quantized-weight kernels vs the formats' CPU reference"
      .gpu/kernels-quant --nocapture
      echo "== GGUF fixtures: mean NLL over tests/fixtures/models/llama/ppl.txt, CPU then CUDA (decode path: --chunk 1; batched, dequantized for a GEMM: --chunk 16)"
      for f in tests/fixtures/gguf/*.gguf; do
        # ppl CHUNK GLOBAL-FLAGS...: one line of JSON
        ppl() { c=$1; shift; .gpu/folio --model "$f" "$@" perplexity --file tests/fixtures/models/llama/ppl.txt --chunk "$c" --json | tr -d '\n'; }
        printf '%s cpu %s cuda-f32 %s cuda-bf16 %s cuda-bf16-chunk16 %s\n' "$(basename "$f")" "$(ppl 1 --device cpu)" \
          "$(ppl 1 --device cuda --dtype f32)" "$(ppl 1 --device cuda --dtype bf16)" "$(ppl 16 --device cuda --dtype bf16)"
      done
      echo "== folio bench kernels (the quantized rows: kernels/cuda/quant.cu, candle's QMatMul, the plain bf16 matvec)"
      .gpu/folio bench kernels --device cuda --context "${CONTEXT:-262144}" --json > "$out/bench-kernels.json"
      python3 -c 'import json,sys
d = json.load(open(sys.argv[1])); print("copy bandwidth %.0f GB/s" % (d["copy_bandwidth"] / 1e9))
for r in d["kernels"]:
    if "matvec" in r["kernel"]: print("%-90s %8.1f us %6.0f GB/s %5.1f%% of copy" % (r["kernel"], 1e6 * r["seconds"], r["bytes"] / r["seconds"] / 1e9, 100 * r["of_limit"]))' "$out/bench-kernels.json"
    } 2>&1 | tee "$out/gpu-quant.log"
    ;;
  shape)
    # folio bench --shape over one context length: `tools/gpu-smoke.sh shape <context> <methods>`,
    # methods as --method writes them (hip,buzz:2048,magicpig:2%:bits=9; without a budget, the
    # method's default), Qwen2.5-7B-Instruct-1M's shape, capped to a 24 GiB card ($VRAM), with the
    # weights of $WEIGHTS (bf16,q8_0,q4k; default the shape's dtype); JSON=1 for JSON lines. Log to $OUT.
    tar -C .gpu -xJf .gpu/bundle.tar.xz folio
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    shape=${SHAPE:-assets/shapes/qwen2.5-7b-instruct-1m.json}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      # shellcheck disable=SC2086  # WEIGHTS: the flag and its value, or nothing
      .gpu/folio bench --device cuda --shape "$shape" --context "$2" --method "$3" ${WEIGHTS:+--weights $WEIGHTS} \
        --vram-budget "${VRAM:-24GiB}" --steps "${STEPS:-32}" --warmup 4 ${JSON:+--json}
    } 2>&1 | tee -a "${OUT:-/tmp}/gpu-shape.log"
    ;;
  prefill)
    # folio bench prefill on the GPU under a 24 GiB cap: `tools/gpu-smoke.sh prefill <model
    # folder or shape .json> <tokens,...> [kv dtype]`; RESUME_DIR=<folder> keeps an interrupted
    # file there and resumes it (a prefill longer than one command's time limit).
    tar -C .gpu -xJf .gpu/bundle.tar.xz folio
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    case "$2" in *.json) subject=(--shape "$2") ;; *) subject=(--model "$2") ;; esac
    resume=()
    if [ -n "${RESUME_DIR:-}" ]; then mkdir -p "$RESUME_DIR"; resume=(--dir "$RESUME_DIR" --resume); fi
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      .gpu/folio bench prefill --device cuda "${subject[@]}" --tokens "$3" --kv-dtype "${4:-bf16}" \
        --vram-budget 24GiB "${resume[@]}"
    } 2>&1 | tee -a "${OUT:-/tmp}/gpu-prefill.log"
    ;;
  peer)
    # Issue #19's comparison in one command: Folio's prefill of shape S at T tokens under a
    # 24 GiB cap (with a profile of the first length), then transformers on the same GPU, and
    # Folio ÷ peer per length. `tools/gpu-smoke.sh peer <shape .json> <tokens,...> [kv dtype]`.
    tar -C .gpu -xJf .gpu/bundle.tar.xz folio
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    out=${OUT:-/tmp}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      .gpu/folio bench prefill --device cuda --shape "$2" --tokens "$3" --kv-dtype "${4:-fp8}" \
        --vram-budget 24GiB --profile --json > "$out/folio-prefill.json"
      python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); p = d["profile"]
for r in d["rows"]:
    print("folio %8d tokens %7.2f s %7.0f tok/s %5.1f%% of GEMM, peak VRAM %.1f GiB, hidden states in %s; stages %s"
          % (r["tokens"], r["prefill_seconds"], r["tokens_per_s"], 100 * r["flops_ratio_to_matmul"],
             r["peak_vram_bytes"] / 2**30, r["hidden_in"], {k: round(v, 2) for k, v in r["stages"].items()}))
print("profile of %d tokens, %.2f s:" % (p["tokens"], p["seconds"]))
for s in p["spans"]: print("  %-28s %8.3f s %5.1f%%" % (s["name"], s["seconds"], 100 * s["seconds"] / p["seconds"]))' \
        "$out/folio-prefill.json"
      python3 tools/peer-prefill.py --shape "$2" --tokens "$3" --folio "$out/folio-prefill.json" \
        --json "$out/peer-prefill.json"
    } 2>&1 | tee "$out/gpu-peer.log"
    ;;
  needle)
    # The demo model's needle eval over every offloaded method on the same prompts:
    # `tools/gpu-smoke.sh needle [lengths] [samples]` (default 1M, 2 per depth). Each prompt's
    # documents are prefilled once for all methods (--offload --methods); the prompts dense
    # missed go through transformers (tools/demo_check_ids.py: the model's miss or the engine's).
    # $PREFILL prefills the documents sparsely (sparse[:KNOBS], `--prefill`); the same prompts
    # as a dense run of the same seed. Everything lands in ONE tar under $OUT ($TAR.tar.gz,
    # default needle): the device tool returns a limited number of files per command.
    # FOLIO=<binary> DEVICE=cpu runs it here (a dry run at small lengths).
    demo_eval_setup needle
    methods=${METHODS:-dense,hip:2048,hip:2%,topk:1%,magicpig:2%,double-sparsity:5%,buzz:50%,streaming:5%}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
      "$folio" calibrate --model "$model" --docs assets/samples || echo "calibrate exit status $?"
      # Cut short (device time), the reports hold every cell reached; the tar still follows.
      timeout "${EVAL_SECONDS:-480}" "$folio" eval needle --model "$model" --device "${DEVICE:-cuda}" \
        --lengths "${2:-1M}" --depths 0,0.25,0.5,0.75,1 --samples "${3:-2}" --offload --methods "$methods" \
        --prefill "${PREFILL:-dense}" --out "$res" || echo "eval exit status $?"
      if [ -d "$res/dense/misses" ]; then
        echo "== transformers on the prompts dense missed"
        timeout "${CHECK_SECONDS:-120}" python3 tools/demo_check_ids.py "$model" "$res/dense/misses" 2>&1 \
          | grep -v Warning || true
      fi
      find "$res" -name '*.u32' -delete   # 4 MiB per 1M-token prompt
    } 2>&1 | tee "$res/needle.log" || true
    tar -C "$(dirname "$res")" -czf "${OUT:-/tmp}/${TAR:-needle}.tar.gz" needle
    ;;
  fidelity)
    # The demo model's answers against dense attention on the fidelity tasks (chain, pair,
    # needle), every offloaded method on the same prompts (folio eval fidelity):
    # `tools/gpu-smoke.sh fidelity LENGTHS [DEPTHS] [SAMPLES]`, the methods in $METHODS (default:
    # every method at its paper default), the budgets in $BUDGETS (a budget curve per method),
    # the question mode in $QUESTION (dense|sparse|both), the documents' prefill in $PREFILL
    # (dense, or sparse[:KNOBS]: `--prefill`), the prompts' seed in $SEED (0). One tar under
    # $OUT ($TAR.tar.gz, default fidelity), as for needle;
    # the missed prompts' token ids are kept up to 256k tokens (a 1M prompt's are 4 MiB).
    demo_eval_setup fidelity
    methods=${METHODS:-streaming,hip,topk,magicpig,double-sparsity,buzz}
    budgets=${BUDGETS:+--budgets $BUDGETS}
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
      "$folio" calibrate --model "$model" --docs assets/samples || echo "calibrate exit status $?"
      # shellcheck disable=SC2086  # $budgets is a flag and its value, or nothing
      timeout "${EVAL_SECONDS:-480}" "$folio" eval fidelity --model "$model" --device "${DEVICE:-cuda}" \
        --lengths "${2:-128k}" --depths "${3:-0.25,0.5,0.75}" --samples "${4:-1}" --offload \
        --methods "$methods" $budgets --question "${QUESTION:-dense}" --prefill "${PREFILL:-dense}" \
        --seed "${SEED:-0}" --out "$res" \
        || echo "eval exit status $?"
      find "$res" -name '*.u32' -size +1M -delete
    } 2>&1 | tee "$res/fidelity.log" || true
    tar -C "$(dirname "$res")" -czf "${OUT:-/tmp}/${TAR:-fidelity}.tar.gz" fidelity
    ;;
  *) echo "usage: $0 pack|run|kernels|tiers|shape|prefill|peer|needle|fidelity" >&2; exit 2 ;;
esac
