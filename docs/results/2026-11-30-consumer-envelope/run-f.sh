set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in mk-magicpig models-host-budget; do
  .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
S=assets/shapes/qwen2.5-7b-instruct-1m.json
M=streaming,buzz,hip,magicpig:2048:dense_layers=0
.gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method $M --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-l25-fp8.jsonl 2> $OUT/h60-l25-fp8.err; tail -3 $OUT/h60-l25-fp8.err
python3 tools/bench-summary.py $OUT/h60-l25-fp8.jsonl
.gpu/folio --host-budget 60GiB bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method magicpig:2048:dense_layers=0 --vram-budget 24GiB --steps 32 --warmup 4 --profile --json > $OUT/h60-fp8-magicpig.jsonl 2> $OUT/h60-fp8-magicpig.err; tail -3 $OUT/h60-fp8-magicpig.err
python3 tools/bench-summary.py $OUT/h60-fp8-magicpig.jsonl
cd $OUT && tar czf results-f.tgz *.log *.jsonl *.err
