set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu=$NCU"
S=assets/shapes/qwen2.5-7b-instruct-1m.json
.gpu/folio bench --device cuda --shape $S --context 4096 --method streaming,hip --vram-budget 24GiB --steps 16 --warmup 2 --json > $OUT/short.jsonl 2> $OUT/short.err; echo "short rc=$? $(( $(date +%s)-T0 ))s"
python3 tools/bench-summary.py $OUT/short.jsonl | head -20
timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base .gpu/folio bench --device cuda --shape $S --context 4096 --method streaming --vram-budget 24GiB --steps 2 --warmup 1 > $OUT/ncu-short.csv 2> $OUT/ncu-short.err; echo "ncu short rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/ncu-short.err
timeout 240 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --kernel-name regex:'hip_search|gather' --launch-count 400 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip --vram-budget 24GiB --steps 4 --warmup 1 > $OUT/ncu-hip.csv 2> $OUT/ncu-hip.err; echo "ncu hip rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/ncu-hip.err
ls -la $OUT
