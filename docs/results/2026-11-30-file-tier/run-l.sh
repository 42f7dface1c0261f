set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
D=/tmp/folio-kv; mkdir -p $D
M=dense,hip:2048,topk:1%,buzz:50%,streaming:5%
COMMON="eval needle --device cuda --model assets/models/demo --lengths 1M --depths 0,0.25,0.5,0.75,1 --samples 1 --methods $M --kv-on-disk $D"
timeout 250 .gpu/folio $COMMON --out $OUT/in-place > $OUT/in-place.log 2>&1; echo "in place rc=$?"; grep -E "correct|error" $OUT/in-place.log | head -30
timeout 320 .gpu/folio $COMMON --kv-cache 64MiB --out $OUT/file-tier > $OUT/file-tier.log 2>&1; echo "file tier rc=$?"; grep -E "correct|error" $OUT/file-tier.log | head -30
cd $OUT && tar czf results-l.tgz *.log in-place file-tier 2>/dev/null; ls
