set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
D=/tmp/folio-kv
B="bench --device cuda --shape $S --context 1048576 --kv-dtype fp8 --kv-on-disk $D --vram-budget 24GiB"
NVME="--host-budget 28GiB --link-gbps 25 --disk-gbps 5 --disk-iops 500000"
( while sleep 30; do echo "$(date +%T) $(df -h /tmp | tail -1 | awk '{print $3}') used; $(free -g | awk '/Mem/{print $3" GiB used, "$6" cache"}')"; done ) > $OUT/watch.txt 2>&1 &
W=$!
RUST_LOG=folio_models=info timeout 520 .gpu/folio $NVME $B --method magicpig:2048:dense_layers=0 --steps 4 --warmup 1 --profile > $OUT/b-magicpig-profile.txt 2> $OUT/b-magicpig.err; echo "magicpig rc=$?"
kill $W
tail -5 $OUT/b-magicpig.err | cut -c1-400
grep -c "tables built" $OUT/b-magicpig.err
grep "tables built" $OUT/b-magicpig.err | head -3 | cut -c1-300
grep "tables built" $OUT/b-magicpig.err | tail -2 | cut -c1-300
grep "written to disk" $OUT/b-magicpig.err | head -2 | cut -c1-300
python3 tools/bench-summary.py $OUT/c-h28-l25-nvme-magicpig.jsonl
tail -4 $OUT/watch.txt
rm -rf $D
