set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB --json --steps 24 --warmup 4"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
RUST_LOG=folio_models=info timeout 150 .gpu/folio $NVME $B --method hip,streaming > $OUT/g-h28-l25-nvme-hip-auto.jsonl 2> $OUT/g.err; echo "rc=$? $(( $(date +%s)-T0 ))s"; grep 'host link, for' $OUT/g.err | cut -c30-200; tail -1 $OUT/g.err | cut -c1-200
rm -rf $D
python3 tools/bench-summary.py $OUT/g-h28-l25-nvme-hip-auto.jsonl | grep -E "mean|per step|ahead|peakRSS"
