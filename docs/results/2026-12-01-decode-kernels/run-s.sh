set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
timeout 100 .gpu/models-parity > $OUT/test-models-parity.log 2>&1; echo "parity rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-models-parity.log | head -4
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 150 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,streaming,buzz --vram-budget 24GiB --steps 16 --warmup 2 --json > $OUT/s-1m.jsonl 2> $OUT/s.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/s.err | cut -c1-200
python3 tools/bench-summary.py $OUT/s-1m.jsonl | grep -E "mean"
