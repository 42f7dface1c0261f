set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
.gpu/models-memory --nocapture > $OUT/memory-test.log 2>&1; echo "memory test rc=$?"; grep -E "^test |test result" $OUT/memory-test.log
.gpu/models-parity --test-threads 1 --nocapture cuda_logits_match_cpu > $OUT/parity-cuda.log 2>&1; echo "parity rc=$?"; grep -E "test result" $OUT/parity-cuda.log
S=assets/shapes/qwen2.5-7b-instruct-1m.json
for w in plain q8_0 q4k; do
  .gpu/folio bench prefill --shape $S --tokens 32768 --kv-dtype fp8 --vram-budget 24GiB --device cuda --weights $w --json > $OUT/prefill-$w.json 2> $OUT/prefill-$w.err
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r["tokens"], "%.0f tok/s" % r["tokens_per_s"], "%.2f s" % r["prefill_seconds"], "peak VRAM %.1f GiB" % (r["peak_vram_bytes"]/2**30), r["stages"]) for r in d["rows"]]' $OUT/prefill-$w.json $w || tail -3 $OUT/prefill-$w.err
done
python3 tools/peer-prefill.py --shape $S --tokens 32768 --attn sdpa --folio $OUT/prefill-plain.json --json $OUT/peer.json 2>&1 | grep -v Warning | tail -4
.gpu/folio bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip --weights q4k --vram-budget 12GiB --steps 32 --warmup 4 --profile --json > $OUT/bench-12gib-q4k.jsonl 2> $OUT/bench-12gib.err; tail -3 $OUT/bench-12gib.err
python3 tools/bench-summary.py $OUT/bench-12gib-q4k.jsonl | grep -v "^     "
.gpu/folio bench --device cuda --shape $S --context 1048576 --method streaming,buzz,hip --weights bf16,q8_0,q4k --vram-budget 24GiB --steps 48 --warmup 4 --profile --json > $OUT/bench-24gib.jsonl 2> $OUT/bench-24gib.err; tail -3 $OUT/bench-24gib.err
python3 tools/bench-summary.py $OUT/bench-24gib.jsonl | grep -v "^     "
