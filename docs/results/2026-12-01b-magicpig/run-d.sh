set -u
T0=$(date +%s)
[ -x .gpu/folio ] || tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
D=/tmp/folio-kv; mkdir -p $D; M=/tmp/demo-copy; rm -rf $M; cp -r assets/models/demo $M
.gpu/folio calibrate --model $M --device cuda --docs assets/samples > $OUT/calibrate.log 2>&1; echo "calibrate rc=$? $(( $(date +%s)-T0 ))s"
COMMON="eval needle --device cuda --model $M --lengths 1M --samples 1 --kv-on-disk $D"
timeout 200 .gpu/folio $COMMON --depths 0,0.25,0.5,0.75,1 --methods double-sparsity --out $OUT/ds-in-place > $OUT/ds-in-place.log 2>&1; echo "ds in place rc=$? $(( $(date +%s)-T0 ))s"
timeout 240 .gpu/folio $COMMON --depths 0,0.25,0.5,0.75,1 --methods double-sparsity --kv-cache 64MiB --out $OUT/ds-file-tier > $OUT/ds-file-tier.log 2>&1; echo "ds file tier rc=$? $(( $(date +%s)-T0 ))s"
timeout 130 .gpu/folio $COMMON --depths 1 --methods dense,hip:2048,topk:1%,buzz:50%,streaming:5% --kv-cache 64MiB --out $OUT/depth1-file-tier > $OUT/depth1-file-tier.log 2>&1; echo "depth 1 file tier rc=$? $(( $(date +%s)-T0 ))s"
grep -hE "correct|expected" $OUT/*.log
find $OUT -name '*.u32' -delete
