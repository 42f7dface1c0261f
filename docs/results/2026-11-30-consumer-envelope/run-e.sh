set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | head -2
for t in kernels-link mk-magicpig mk-hip; do
  .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
.gpu/folio bench link --device cuda --json > $OUT/link.json 2> $OUT/link.err; tail -2 $OUT/link.err
python3 -c '
import json,sys; d=json.load(open(sys.argv[1])); print(d["device"], "copy %.1f GB/s" % (d["copy_rate"]/1e9))
for r in d["rows"]: print("asked", "%5s" % ("%.0f" % (r["asked"]/1e9) if r["asked"] else "as is"), "picks %6d" % r["picks"], "%8.1f us" % (r["seconds"]*1e6), "%6.2f GB/s" % (r["rate"]/1e9), "of asked %s" % ("%.3f" % r["of_asked"] if r["of_asked"] else "-"))
' $OUT/link.json
S=assets/shapes/qwen2.5-7b-instruct-1m.json
.gpu/folio --host-budget 60GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-l25-bf16.jsonl 2> $OUT/h60-l25-bf16.err; tail -3 $OUT/h60-l25-bf16.err
python3 tools/bench-summary.py $OUT/h60-l25-bf16.jsonl
.gpu/folio --host-budget 60GiB bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip --vram-budget 24GiB --steps 32 --warmup 4 --json > $OUT/h60-bf16.jsonl 2> $OUT/h60-bf16.err; tail -3 $OUT/h60-bf16.err
python3 tools/bench-summary.py $OUT/h60-bf16.jsonl
python3 -c '
import json,sys
for l in open(sys.argv[1]):
  d=json.loads(l); print(d["method"], "pcie4 projected mean %.2f ms (from %.2f measured)" % (d["pcie4_mean_ms"], d["decode_ms_mean"]))
' $OUT/h60-bf16.jsonl
cd $OUT && tar czf results-e.tgz *.log *.json *.jsonl *.err
