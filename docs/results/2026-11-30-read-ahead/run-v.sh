set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB --method hip"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
timeout 100 .gpu/folio $NVME $B --steps 8 --warmup 3 --profile > $OUT/v-profile.txt 2>&1; echo "profile rc=$?"
grep -E "decode .* ms/token|host queued|^    [a-z]|      attention|a step read" $OUT/v-profile.txt | head -16
rm -rf $D
for i in 1 2; do
timeout 100 .gpu/folio $NVME $B --json --steps 24 --warmup 4 > $OUT/v-h28-l25-nvme-hip$i.jsonl 2> $OUT/nvme$i.err; echo "nvme$i rc=$?"; tail -2 $OUT/nvme$i.err
python3 tools/bench-summary.py $OUT/v-h28-l25-nvme-hip$i.jsonl | grep -E "mean|per step|ahead"
rm -rf $D
done
