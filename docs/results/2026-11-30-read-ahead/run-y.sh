set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
D=/tmp/folio-kv; mkdir -p $D
timeout 170 .gpu/folio eval needle --device cuda --model assets/models/demo --lengths 1M --depths 0,0.25,0.5 --samples 1 --methods hip:2048 --kv-on-disk $D --kv-cache 64MiB --out $OUT/file-tier > $OUT/needle-file-tier.log 2>&1; echo "file tier rc=$?"
grep -E "correct|error" $OUT/needle-file-tier.log | head
grep -h '"output"' -r $OUT/file-tier | head
