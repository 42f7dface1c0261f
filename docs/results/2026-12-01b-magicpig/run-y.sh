set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 330 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv -k 'regex:lsh_walk|simhash' --launch-count 600 .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0 --kv-dtype bf16 --vram-budget 40GiB --steps 1 --warmup 1 --json > $OUT/y-ncu.csv 2> $OUT/y.err; echo "ncu rc=$? $(( $(date +%s)-T0 ))s"; tail -2 $OUT/y.err | cut -c1-300
python3 - <<PY
import csv, collections
rows=[r for r in csv.reader(l for l in open("$OUT/y-ncu.csv") if l.startswith('"'))]
hdr=[h.strip('"') for h in rows[0]]; ki=hdr.index('Kernel Name'); vi=hdr.index('Metric Value'); gi=hdr.index('Grid Size')
agg=collections.defaultdict(list)
for r in rows[1:]:
    try: agg[(r[ki][:40], r[gi])].append(float(r[vi].replace(',','')))
    except: pass
for k,v in sorted(agg.items()): print('%-42s %-16s n=%3d mean %8.1f us  median %8.1f us' % (k[0],k[1],len(v),sum(v)/len(v)/1e3,sorted(v)[len(v)//2]/1e3))
PY
