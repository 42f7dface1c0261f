set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
.gpu/kernels-link > $OUT/test-kernels-link.log 2>&1; echo "kernels-link rc=$?"; grep -E "test result|panicked" $OUT/test-kernels-link.log
.gpu/folio bench link --device cuda --json > $OUT/link.json 2> $OUT/link.err; tail -2 $OUT/link.err
python3 -c '
import json,sys; d=json.load(open(sys.argv[1])); print(d["device"], "copy %.1f GB/s" % (d["copy_rate"]/1e9))
for r in d["rows"]: print("asked", "%5s" % ("%.0f" % (r["asked"]/1e9) if r["asked"] else "as is"), "picks %6d" % r["picks"], "%8.1f us" % (r["seconds"]*1e6), "%6.2f GB/s" % (r["rate"]/1e9), "of asked %s" % ("%.3f" % r["of_asked"] if r["of_asked"] else "-"))
' $OUT/link.json
S=assets/shapes/qwen2.5-7b-instruct-1m.json
.gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --method magicpig:2048:dense_layers=0,hip --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-l25-fp8-final.jsonl 2> $OUT/final.err; tail -3 $OUT/final.err
python3 tools/bench-summary.py $OUT/h60-l25-fp8-final.jsonl
