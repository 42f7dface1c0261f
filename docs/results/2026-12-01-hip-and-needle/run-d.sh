set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 230 .gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --method hip,hip:512:cpu_search=0 --vram-budget 24GiB --steps 24 --warmup 4 --json > $OUT/d-h60-l25-hip.jsonl 2> $OUT/d-hip.err; echo "hip rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/d-hip.err | cut -c1-300
python3 tools/bench-summary.py $OUT/d-h60-l25-hip.jsonl | head -20
