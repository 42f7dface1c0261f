set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
B="bench --device cuda --shape $S --context 1048576 --vram-budget 24GiB --json --steps 24 --warmup 4"
RUST_LOG=folio_models=info timeout 100 .gpu/folio --host-budget 60GiB --link-gbps 25 $B --method hip,hip:512:cpu_search=0 > $OUT/h-h60-l25-hip.jsonl 2> $OUT/h.err; echo "l25 rc=$? $(( $(date +%s)-T0 ))s"; grep 'host link, for' $OUT/h.err | cut -c30-200
python3 tools/bench-summary.py $OUT/h-h60-l25-hip.jsonl | grep -E "mean|peakRSS"
