#!/usr/bin/env bash
# GPU run: the walk-first branch's test binaries (select, offload, context's CUDA decode test), then
# MagicPIG's default at 1M with each bundle in $BUNDLES (in order), one process each.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} RUST_BACKTRACE=0
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
cat .gpu/BUNDLE_COMMIT .gpu/WALK_COMMIT; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E "Model name|Socket"; free -g | head -2
if [ "${TESTS:-1}" = 1 ]; then
  mkdir -p .gpu/t && tar -C .gpu/t -xJf .gpu/t.tar.xz
  for t in select offload; do timeout 150 .gpu/t/$t --nocapture > $OUT/$t.log 2>&1; echo "== $t: $(grep -E '^test result' $OUT/$t.log)"; grep -E "FAILED|panicked|Error" $OUT/$t.log | head -12; done
  timeout 150 .gpu/t/context offloaded_decode_matches_resident --nocapture > $OUT/context.log 2>&1; echo "== context: $(grep -E '^test result' $OUT/context.log)"; grep -E "FAILED|panicked|Error" $OUT/context.log | head -12
  (cd $OUT && tar -czf tests.tgz *.log && rm *.log)
fi
M=${M:-magicpig:2048:dense_layers=0}
for b in ${BUNDLES:-bundle walk}; do
  rm -f .gpu/folio; tar -C .gpu -xJf .gpu/$b.tar.xz; s=$(date +%s)
  .gpu/folio bench --device cuda --shape assets/shapes/qwen2.5-7b-instruct-1m.json --context ${CTX:-1048576} \
    --method $M --kv-dtype bf16 --vram-budget 24GiB --steps ${STEPS:-16} --warmup 2 --profile --json > $OUT/$b.jsonl 2> $OUT/$b.err
  echo "== $b ($(( $(date +%s) - s )) s)"; tail -2 $OUT/$b.err; python3 .gpu/summ.py $OUT/$b.jsonl
done
