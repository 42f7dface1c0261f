set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 400 ncu --clock-control none --cache-control none -k 'regex:lsh_(walk|attend)' --launch-skip 120 --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0 --kv-dtype bf16 --vram-budget 24GiB --steps 1 --warmup 1 --json > $OUT/w-ncu.txt 2> $OUT/w.err; echo "ncu rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/w.err | cut -c1-300
grep -v '^{' $OUT/w-ncu.txt | grep -E "lsh_|Duration|Throughput|Stall|Issued|Active Warps|Achieved Occ|Registers|Shared Memory|Waves|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|No Eligible|One or More|Eligible Warps|Warp Cycles" | head -120
