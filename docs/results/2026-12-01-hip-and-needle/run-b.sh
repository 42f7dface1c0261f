set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in models-offload mk-hip; do
  timeout 120 .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
grep -E "Cuda.*hip" $OUT/test-models-offload.log | head -4
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 170 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,hip:512:cpu_search=0 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/b-hip-cpu-search.jsonl 2> $OUT/b-hip.err; echo "hip rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/b-hip.err | cut -c1-300
python3 tools/bench-summary.py $OUT/b-hip-cpu-search.jsonl | head -44
D=/tmp/folio-kv; mkdir -p $D
LEFT=$(( 585 - ($(date +%s)-T0) ))
RUST_LOG=folio_models=info timeout $LEFT .gpu/folio eval needle --device cuda --model assets/models/demo --lengths 1M --depths 0,0.25,0.5,0.75,1 --samples 1 --methods magicpig:2% --kv-on-disk $D --kv-cache 64MiB --out $OUT/file-tier > $OUT/file-tier.log 2> $OUT/file-tier.err; echo "file tier rc=$? $(( $(date +%s)-T0 ))s"; grep -E "correct|error" $OUT/file-tier.log | head -20; grep -c "tables built" $OUT/file-tier.err
rm -rf $D
