set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
for t in mk-hip kernels-select models-offload; do
  timeout 200 .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
grep -E "Cuda.*hip" $OUT/test-models-offload.log | head -4
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 200 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,streaming,buzz --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/m1.jsonl 2> $OUT/m1.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/m1.err | cut -c1-300
python3 tools/bench-summary.py $OUT/m1.jsonl | grep -E "mean|floor"
timeout 200 .gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --method hip,hip:512:cpu_search=0,streaming,buzz --vram-budget 24GiB --steps 24 --warmup 4 --json > $OUT/h60-l25.jsonl 2> $OUT/h60.err; echo "h60 rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/h60.err | cut -c1-300
python3 tools/bench-summary.py $OUT/h60-l25.jsonl | grep -E "mean|floor"
