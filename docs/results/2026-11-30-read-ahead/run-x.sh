set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
for t in models-offload models-context; do
  timeout 150 .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB --json"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
timeout 200 .gpu/folio $NVME $B --method streaming,buzz,hip --steps 24 --warmup 4 > $OUT/x-h28-l25-nvme.jsonl 2> $OUT/nvme.err; echo "nvme rc=$?"; tail -2 $OUT/nvme.err
python3 tools/bench-summary.py $OUT/x-h28-l25-nvme.jsonl | grep -E "mean|per step|ahead|peakRSS"
rm -rf $D
timeout 100 .gpu/folio $NVME $B --method hip --steps 24 --warmup 4 > $OUT/x-h28-l25-nvme-hip2.jsonl 2> $OUT/nvme2.err; echo "nvme2 rc=$?"; tail -2 $OUT/nvme2.err
python3 tools/bench-summary.py $OUT/x-h28-l25-nvme-hip2.jsonl | grep -E "mean|per step|ahead|peakRSS"
rm -rf $D
