#!/usr/bin/env bash
# GPU run (twenty-second session): every method at its default budget at 1M with the current code
# (walk.tar.xz = HEAD's code), one process; then the select/offload/context GPU tests. Run as
# .gpu/all.sh (it finds the repository one folder up), with walk.tar.xz and t.tar.xz packed there.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} RUST_BACKTRACE=0
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
cat .gpu/WALK_COMMIT; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E "Model name|Socket"; free -g | head -2
rm -f .gpu/folio; tar -C .gpu -xJf .gpu/walk.tar.xz folio; s=$(date +%s)
.gpu/folio bench --device cuda --shape assets/shapes/qwen2.5-7b-instruct-1m.json --context 1048576 \
  --method ${M:-streaming,buzz,hip,double-sparsity,topk,dense} --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/all.jsonl 2> $OUT/all.err
echo "== bench ($(( $(date +%s) - s )) s)"; tail -2 $OUT/all.err; python3 .gpu/summ.py $OUT/all.jsonl | grep -v "^    "
if [ "${TESTS:-1}" = 1 ]; then
  mkdir -p .gpu/t && tar -C .gpu/t -xJf .gpu/t.tar.xz
  for t in select offload; do timeout 120 .gpu/t/$t --nocapture > $OUT/$t.log 2>&1; echo "== $t: $(grep -E '^test result' $OUT/$t.log)"; grep -E "FAILED|panicked|Error" $OUT/$t.log | head -12; done
  timeout 120 .gpu/t/context offloaded_decode_matches_resident --nocapture > $OUT/context.log 2>&1; echo "== context: $(grep -E '^test result' $OUT/context.log)"; grep -E "FAILED|panicked|Error" $OUT/context.log | head -12
  (cd $OUT && tar -czf tests.tgz *.log && rm *.log)
fi
