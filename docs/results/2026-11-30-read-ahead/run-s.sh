set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --vram-budget 24GiB --method hip --steps 8 --warmup 3 --profile"
timeout 150 .gpu/folio --host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000 $B --kv-on-disk $D > $OUT/s-nvme-profile.txt 2>&1; echo "nvme rc=$?"
rm -rf $D
timeout 150 .gpu/folio --host-budget 60GiB --link-gbps 25 $B > $OUT/s-h60-profile.txt 2>&1; echo "h60 rc=$?"
grep -v "^\s*$" $OUT/s-nvme-profile.txt | tail -45
echo ======
grep -v "^\s*$" $OUT/s-h60-profile.txt | tail -45
