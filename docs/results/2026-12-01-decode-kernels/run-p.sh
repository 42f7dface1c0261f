set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
for t in kernels-gemv kernels-argmax models-parity; do
  timeout 200 .gpu/$t > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
timeout 150 .gpu/folio bench kernels --device cuda --context 65536 --select 1024 --json > $OUT/kernels.json 2> $OUT/kernels.err; echo "kernels rc=$? $(( $(date +%s)-T0 ))s"
python3 -c '
import json,sys; d=json.load(open(sys.argv[1]))
rows = d["rows"] if "rows" in d else d.get("kernels", [])
for r in rows:
    k = r.get("kernel", "")
    if "matvec" in k and "quantized" not in k: print(json.dumps(r))
' $OUT/kernels.json
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 200 .gpu/folio bench --device cuda --shape $S --context 1048576 --method hip,streaming,buzz --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/m1.jsonl 2> $OUT/m1.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/m1.err | cut -c1-300
python3 tools/bench-summary.py $OUT/m1.jsonl | grep -E "mean|floor"
