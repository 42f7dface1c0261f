set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
.gpu/models-offload > $OUT/test-models-offload.log 2>&1; echo "models-offload rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-models-offload.log | head -5
S=assets/shapes/qwen2.5-7b-instruct-1m.json
.gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method magicpig:2048:dense_layers=0 --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-l25-fp8-magicpig-default.jsonl 2> $OUT/default.err; tail -3 $OUT/default.err
python3 tools/bench-summary.py $OUT/h60-l25-fp8-magicpig-default.jsonl
