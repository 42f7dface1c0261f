set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in kernels-norm models-parity; do
  timeout 200 .gpu/$t > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
grep -E "cuda (BF16|F32)" $OUT/test-models-parity.log | head -8
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 330 .gpu/folio bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip,hip:512:refresh=4096 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/m1.jsonl 2> $OUT/m1.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/m1.err | cut -c1-300
python3 tools/bench-summary.py $OUT/m1.jsonl | grep -E "mean|floor"
timeout 240 .gpu/folio bench prefill --device cuda --shape $S --tokens 131072,32768 --kv-dtype fp8 --vram-budget 24GiB --profile --json > $OUT/folio-prefill.json 2> $OUT/prefill.err; echo "prefill rc=$? $(( $(date +%s)-T0 ))s"
python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); p = d["profile"]
for r in d["rows"]:
    print("folio %8d tokens %7.2f s %7.0f tok/s %5.1f%% of GEMM, peak VRAM %.1f GiB" % (r["tokens"], r["prefill_seconds"], r["tokens_per_s"], 100 * r["flops_ratio_to_matmul"], r["peak_vram_bytes"] / 2**30))
print("profile of %d tokens, %.2f s:" % (p["tokens"], p["seconds"]))
for s in p["spans"]: print("  %-28s %8.3f s %5.1f%%" % (s["name"], s["seconds"], 100 * s["seconds"] / p["seconds"]))' $OUT/folio-prefill.json
timeout 200 python3 tools/peer-prefill.py --shape $S --tokens 131072,32768 --folio $OUT/folio-prefill.json --json $OUT/peer-prefill.json 2>&1 | tail -8
echo "done $(( $(date +%s)-T0 ))s"
