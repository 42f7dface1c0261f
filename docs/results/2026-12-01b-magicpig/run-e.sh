set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; lscpu | grep -E "Model name"
S=assets/shapes/qwen2.5-7b-instruct-1m.json
M=magicpig:2048:dense_layers=0
timeout 560 .gpu/folio bench --device cuda --shape $S --context 1048576 --method $M,$M:balance=1,$M --kv-dtype bf16 --vram-budget 24GiB --steps 48 --warmup 4 --json > $OUT/e-magicpig-balance-aba.jsonl 2> $OUT/e.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/e.err | cut -c1-200
python3 tools/bench-summary.py $OUT/e-magicpig-balance-aba.jsonl
python3 -c "
import json
for l in open('$OUT/e-magicpig-balance-aba.jsonl'):
    d=json.loads(l); print(d['method'], d['decode_ms_mean'], d['decode_ms_median'], d['decode_ms_p90'], d.get('learned'))
"
