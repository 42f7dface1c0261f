#!/usr/bin/env bash
# The cost of weighing sources by attention mass (`folio chat --sources`, what the window does) on
# the GPU: dense and hip decode with and without it, on demo-model contexts of ~30k and ~115k
# tokens (resident tier), five answers each; mean, median and the slowest. Run on the device
# after `tools/gpu-smoke.sh pack` (carry [".gpu"]): `bash tools/sources-bench.sh`.
set -euo pipefail
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader
w=$(mktemp -d)
for copies in 44 166; do
  mkdir -p "$w/d$copies"
  for f in assets/samples/*.txt; do python3 -c "import sys; t=open(sys.argv[1]).read(); open(sys.argv[2],'w').write(t*int(sys.argv[3]))" "$f" "$w/d$copies/$(basename $f)" "$copies"; done
  .gpu/folio prefill --model assets/models/demo --device cuda --docs "$w/d$copies" --out "$w/c$copies.folio" --json --no-library \
    | python3 -c 'import json,sys; r=json.load(sys.stdin)["report"]; print("context", r["tokens"], "tokens, prefill", round(r["seconds"],2), "s")'
  for m in dense hip; do
    for s in "" "--sources"; do
      rates=()
      for i in 1 2 3 4 5; do
        r=$(.gpu/folio chat --context "$w/c$copies.folio" --device cuda --method "$m" $s --temperature 0 --max-tokens 64 --json \
          "what is the lucky number of jade tiger ?" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["decode_tokens_per_second"])')
        rates+=("$r")
      done
      python3 -c "import sys,statistics as st; r=sorted(float(x) for x in sys.argv[2:]); print('%-6s %-10s tok/s mean %.0f median %.0f p90(low) %.0f  all %s' % (sys.argv[1].split()[0], sys.argv[1].split()[1] if len(sys.argv[1].split())>1 else 'rows', st.mean(r), st.median(r), r[0], [round(x) for x in r]))" "$m ${s:-rows}" "${rates[@]}"
    done
  done
done
