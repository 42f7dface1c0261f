set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz folio 2>/dev/null || tar -C .gpu -xJf .gpu/bundle.tar.xz ./folio
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
B="bench --device cuda --shape $S --context 1048576 --vram-budget 24GiB --json --steps 32 --warmup 4"
timeout 200 .gpu/folio --host-budget 60GiB --link-gbps 25 $B --method streaming,buzz,hip > $OUT/q-h60-l25.jsonl 2> $OUT/q60.err; echo "h60 rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/q60.err | cut -c1-200
python3 tools/bench-summary.py $OUT/q-h60-l25.jsonl | grep -E "mean|peakRSS"
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB --json --steps 24 --warmup 4"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
timeout 250 .gpu/folio $NVME $B --method hip,streaming,buzz > $OUT/q-h28-l25-nvme.jsonl 2> $OUT/q28.err; echo "h28 rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/q28.err | cut -c1-200
rm -rf $D
python3 tools/bench-summary.py $OUT/q-h28-l25-nvme.jsonl | grep -E "mean|per step|peakRSS"
