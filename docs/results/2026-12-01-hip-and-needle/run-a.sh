set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in models-offload models-context; do
  timeout 150 .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
grep -E "magicpig, file" $OUT/test-models-context.log | head -3
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 170 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,hip:512:refresh=4096 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/a-hip-refresh.jsonl 2> $OUT/a-hip.err; echo "hip rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/a-hip.err | cut -c1-300
python3 tools/bench-summary.py $OUT/a-hip-refresh.jsonl | head -40
D=/tmp/folio-kv; mkdir -p $D
COMMON="eval needle --device cuda --model assets/models/demo --lengths 1M --depths 0,0.25,0.5,0.75,1 --samples 1 --methods magicpig:2% --kv-on-disk $D"
LEFT=$(( 590 - ($(date +%s)-T0) ))
timeout $(( LEFT * 55 / 100 )) .gpu/folio $COMMON --kv-cache 64MiB --out $OUT/file-tier > $OUT/file-tier.log 2>&1; echo "file tier rc=$? $(( $(date +%s)-T0 ))s"; grep -E "correct|error|spill" $OUT/file-tier.log | head -20
LEFT=$(( 590 - ($(date +%s)-T0) ))
timeout $LEFT .gpu/folio $COMMON --out $OUT/in-place > $OUT/in-place.log 2>&1; echo "in place rc=$? $(( $(date +%s)-T0 ))s"; grep -E "correct|error" $OUT/in-place.log | head -20
rm -rf $D
