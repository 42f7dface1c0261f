set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
B="bench --device cuda --shape $S --context 1048576 --vram-budget 24GiB --json"
RUST_LOG=folio_models=info timeout 150 .gpu/folio $B --method hip,streaming --steps 24 --warmup 4 > $OUT/e-h200-hip-auto.jsonl 2> $OUT/e-h200.err; echo "h200 rc=$? $(( $(date +%s)-T0 ))s"; grep 'host link, for' $OUT/e-h200.err | cut -c1-300
RUST_LOG=folio_models=info timeout 150 .gpu/folio --host-budget 60GiB --link-gbps 25 $B --method hip,streaming --steps 24 --warmup 4 > $OUT/e-h60-l25-hip-auto.jsonl 2> $OUT/e-l25.err; echo "l25 rc=$? $(( $(date +%s)-T0 ))s"; grep 'host link, for' $OUT/e-l25.err | cut -c1-300
python3 tools/bench-summary.py $OUT/e-h200-hip-auto.jsonl $OUT/e-h60-l25-hip-auto.jsonl | grep -E 'mean|kv tier'
