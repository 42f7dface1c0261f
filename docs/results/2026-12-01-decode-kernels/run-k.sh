set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
for t in kernels-norm kernels-heads kernels-argmax mk-hip models-offload models-context; do
  timeout 200 .gpu/$t > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
S=assets/shapes/qwen2.5-7b-instruct-1m.json
.gpu/folio bench --device cuda --shape $S --context 4096 --method streaming,hip --vram-budget 24GiB --steps 16 --warmup 2 --json > $OUT/short.jsonl 2> $OUT/short.err; echo "short rc=$? $(( $(date +%s)-T0 ))s"
python3 tools/bench-summary.py $OUT/short.jsonl | grep mean
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base .gpu/folio bench --device cuda --shape $S --context 4096 --method streaming --vram-budget 24GiB --steps 2 --warmup 1 > $OUT/ncu-short.csv 2> $OUT/ncu-short.err; echo "ncu short rc=$? $(( $(date +%s)-T0 ))s"
timeout 300 .gpu/folio bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/m1.jsonl 2> $OUT/m1.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/m1.err | cut -c1-300
python3 tools/bench-summary.py $OUT/m1.jsonl | grep -E "mean|floor"
