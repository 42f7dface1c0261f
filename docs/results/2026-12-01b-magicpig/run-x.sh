set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
for t in kernels-sparse method-kernels-magicpig models-offload; do
  timeout 150 .gpu/$t --test-threads 1 > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
grep -E "identical codes" $OUT/test-kernels-sparse.log | head -8
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 420 .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0,magicpig:2048:dense_layers=0:gpu_attend=0.57 --kv-dtype bf16 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/x-magicpig-1m.jsonl 2> $OUT/x.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/x.err | cut -c1-200
python3 tools/bench-summary.py $OUT/x-magicpig-1m.jsonl | grep -E "mean"
python3 -c "
import json
for l in open('$OUT/x-magicpig-1m.jsonl'):
    d=json.loads(l)
    print(d['method'], d['decode_ms_mean'], d['decode_ms_median'], d['decode_ms_p90'], d['floor_ms'], d['measured_over_floor'], d['peak_rss_bytes']/2**30)
    for s in d['profile']['spans']: print('  %-45s host %7.2f dev %7.2f' % (s['name'], s['host_ms'], s['device_ms']))
"
