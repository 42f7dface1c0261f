set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
P=magicpig:2048:dense_layers=0
.gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method $P:gpu_attend=1,$P:gpu_attend=0.85,$P:balance=1 --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-l25-fp8-magicpig-split.jsonl 2> $OUT/split.err; tail -3 $OUT/split.err
python3 tools/bench-summary.py $OUT/h60-l25-fp8-magicpig-split.jsonl
