set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2
(cd .gpu && nvcc -O3 -arch=sm_90 -std=c++17 -o zc-probe4 zc-probe4.cu) && timeout 200 .gpu/zc-probe4 > $OUT/zc-probe4.txt 2>&1; echo "probe rc=$? $(( $(date +%s)-T0 ))s"; cat $OUT/zc-probe4.txt
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 300 .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0 --kv-dtype bf16 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/t-magicpig-1m.jsonl 2> $OUT/t.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/t.err | cut -c1-200
python3 tools/bench-summary.py $OUT/t-magicpig-1m.jsonl | grep -E "mean"
python3 -c "
import json
d=json.loads(open('$OUT/t-magicpig-1m.jsonl').readlines()[-1])
print(d['decode_ms_mean'], d['floor_ms'], d['measured_over_floor'], d['peak_rss_bytes']/2**30)
for s in d['profile']['spans']: print('%-45s host %7.2f dev %7.2f' % (s['name'], s['host_ms'], s['device_ms']))
"
