set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2
for t in kernels-sparse method-kernels-magicpig models-offload; do
  timeout 150 .gpu/$t --test-threads 1 > $OUT/test-$t.log 2>&1; echo "$t rc=$? $(( $(date +%s)-T0 ))s"; grep -E "test result|panicked|FAILED" $OUT/test-$t.log | head -4
done
cp docs/results/2026-12-01b-magicpig/zc-probe6.cu .gpu/
(cd .gpu && nvcc -O3 -arch=sm_90 -std=c++17 -o zc-probe6 zc-probe6.cu 2>/dev/null) && timeout 120 .gpu/zc-probe6 > $OUT/zc-probe6.txt 2>&1; echo "probe rc=$? $(( $(date +%s)-T0 ))s"; cat $OUT/zc-probe6.txt
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 330 .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0,hip --kv-dtype bf16 --vram-budget 24GiB --steps 16 --warmup 2 --profile --json > $OUT/b-magicpig-hip-1m.jsonl 2> $OUT/b.err; echo "1M rc=$? $(( $(date +%s)-T0 ))s"; tail -1 $OUT/b.err | cut -c1-200
python3 tools/bench-summary.py $OUT/b-magicpig-hip-1m.jsonl
