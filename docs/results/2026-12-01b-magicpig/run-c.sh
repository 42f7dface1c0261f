set -u
T0=$(date +%s)
[ -x .gpu/folio ] || tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 400 .gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method magicpig:2048:dense_layers=0 --vram-budget 24GiB --steps 32 --warmup 4 --profile --json > $OUT/c-h60-l25-magicpig-fp8.jsonl 2> $OUT/c.err; echo "desktop rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/c.err | cut -c1-200
python3 tools/bench-summary.py $OUT/c-h60-l25-magicpig-fp8.jsonl
