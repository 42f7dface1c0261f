set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --vram-budget 24GiB --method hip --steps 8 --warmup 3 --profile --kv-on-disk $D"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
FAST="--host-budget 28GiB --link-gbps 25 --disk-gbps 100 --disk-iops 50000000"
for run in "new $NVME" "old $NVME" "new $FAST"; do
  set -- $run; bin=$1; shift
  [ $bin = old ] && exe=.gpu/folio-old || exe=.gpu/folio
  timeout 150 $exe "$@" $B > $OUT/t-$bin-$6.txt 2>&1; echo "$bin $* rc=$?"
  grep -E "decode .* ms/token|host queued|^    [a-z]|      attention|a step read" $OUT/t-$bin-$6.txt | head -24
  rm -rf $D
done
