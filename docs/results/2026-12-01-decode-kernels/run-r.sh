set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz ./folio 2>/dev/null || tar -C .gpu -xJf .gpu/bundle.tar.xz folio
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nproc
S=assets/shapes/qwen2.5-7b-instruct-1m.json
B="bench --device cuda --shape $S --context 1048576 --vram-budget 24GiB --json --steps 16 --warmup 2"
timeout 130 .gpu/folio $B --method hip,hip:512:cpu_search=1 > $OUT/r-16.jsonl 2> $OUT/r16.err; echo "16 threads rc=$? $(( $(date +%s)-T0 ))s"
python3 tools/bench-summary.py $OUT/r-16.jsonl | grep -E "mean"
FOLIO_HOST_THREADS=8 timeout 130 .gpu/folio $B --method hip:512:cpu_search=1 > $OUT/r-8.jsonl 2> $OUT/r8.err; echo "8 threads rc=$? $(( $(date +%s)-T0 ))s"
python3 tools/bench-summary.py $OUT/r-8.jsonl | grep -E "mean"
FOLIO_HOST_THREADS=12 timeout 130 .gpu/folio $B --method hip:512:cpu_search=1 > $OUT/r-12.jsonl 2> $OUT/r12.err; echo "12 threads rc=$? $(( $(date +%s)-T0 ))s"
python3 tools/bench-summary.py $OUT/r-12.jsonl | grep -E "mean"
