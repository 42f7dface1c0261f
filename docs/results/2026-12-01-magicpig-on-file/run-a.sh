set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp /dev/shm | tail -2; free -g | head -2
for t in models-offload models-context; do
  timeout 150 .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
grep -E "magicpig, file" $OUT/test-models-context.log | head -3
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB --json"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
timeout 420 .gpu/folio $NVME $B --method magicpig:2048:dense_layers=0 --steps 8 --warmup 2 > $OUT/a-h28-l25-nvme-magicpig.jsonl 2> $OUT/magicpig.err; echo "magicpig rc=$?"; tail -4 $OUT/magicpig.err
python3 tools/bench-summary.py $OUT/a-h28-l25-nvme-magicpig.jsonl
df -h $D | tail -1
rm -rf $D
