set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
timeout 150 .gpu/models-offload --nocapture > $OUT/test-models-offload.log 2>&1; echo "offload rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-models-offload.log | head -5
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
timeout 100 .gpu/folio $NVME $B --method hip --steps 8 --warmup 3 --profile > $OUT/w-profile.txt 2>&1; echo "profile rc=$?"
grep -E "decode .* ms/token|host queued|^    [a-z]|      attention|a step read" $OUT/w-profile.txt | head -16
rm -rf $D
timeout 200 .gpu/folio $NVME $B --json --method streaming,buzz,hip --steps 24 --warmup 4 > $OUT/w-h28-l25-nvme.jsonl 2> $OUT/nvme.err; echo "nvme rc=$?"; tail -2 $OUT/nvme.err
python3 tools/bench-summary.py $OUT/w-h28-l25-nvme.jsonl
rm -rf $D
for i in 2 3; do
timeout 100 .gpu/folio $NVME $B --json --method hip --steps 24 --warmup 4 > $OUT/w-h28-l25-nvme-hip$i.jsonl 2> $OUT/nvme$i.err; echo "nvme$i rc=$?"; tail -2 $OUT/nvme$i.err
python3 tools/bench-summary.py $OUT/w-h28-l25-nvme-hip$i.jsonl | grep -E "mean|per step|ahead|peakRSS"
rm -rf $D
done
