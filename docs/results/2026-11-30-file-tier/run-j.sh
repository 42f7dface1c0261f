set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | head -2; df -h /tmp | tail -1; findmnt -T /tmp -o SOURCE,FSTYPE | tail -1; nproc
for t in models-offload models-context; do
  .gpu/$t --nocapture > $OUT/test-$t.log 2>&1; echo "$t rc=$?"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -5
done
grep -E "file" $OUT/test-models-context.log | head -8
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
timeout 420 .gpu/folio --host-budget 28GiB --link-gbps 25 bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --method streaming,buzz,hip --vram-budget 24GiB --steps 16 --warmup 4 --json > $OUT/h28-l25-fp8-file.jsonl 2> $OUT/h28.err; echo "bench rc=$?"; tail -3 $OUT/h28.err
python3 tools/bench-summary.py $OUT/h28-l25-fp8-file.jsonl
ls -la $D 2>/dev/null; rm -rf $D
cd $OUT && tar czf results-j.tgz *.log *.jsonl *.err
