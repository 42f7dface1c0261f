set -u
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 150 ncu --clock-control none --section LaunchStats --section Occupancy --csv --print-units base --kernel-name regex:'nvjet|hip_search|decode_rows|rmsnorm|splitK|swiglu' --launch-skip 300 --launch-count 60 .gpu/folio bench --device cuda --shape $S --context 8192 --method hip --vram-budget 24GiB --steps 2 --warmup 1 > $OUT/ncu-occ.csv 2> $OUT/ncu-occ.err; echo "rc=$?"; tail -2 $OUT/ncu-occ.err
python3 - $OUT/ncu-occ.csv <<'PY'
import csv,sys,collections
rows=[r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
want=('Registers Per Thread','Dynamic Shared Memory Per Block','Static Shared Memory Per Block','Block Size','Grid Size','Cluster Size','Theoretical Occupancy','Block Limit Shared Mem','Block Limit Registers','Waves Per SM','Driver Shared Memory Per Block','Shared Memory Configuration Size')
seen={}
for r in rows:
    k=r['Kernel Name'][:60]
    if r['Metric Name'] in want: seen.setdefault(k,{})[r['Metric Name']]=r['Metric Value']
for k,v in seen.items(): print(k, v)
PY
