set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E 'Model name|^CPU\(s\)'
timeout 100 .gpu/models-offload --nocapture > $OUT/test-offload.log 2>&1; echo "offload rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|Cuda.*hip" $OUT/test-offload.log | head -6
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 200 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,hip:512:cpu_search=0,hip:512:refresh=4096 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/c-hip-cpu-search.jsonl 2> $OUT/c-hip.err; echo "hip rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/c-hip.err | cut -c1-300
python3 tools/bench-summary.py $OUT/c-hip-cpu-search.jsonl | head -60
