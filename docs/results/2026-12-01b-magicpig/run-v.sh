set -u
T0=$(date +%s)
tar -C .gpu -xJf .gpu/bundle.tar.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
S=assets/shapes/qwen2.5-7b-instruct-1m.json
timeout 400 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv -k 'regex:lsh_' --launch-skip 120 --launch-count 112 .gpu/folio bench --device cuda --shape $S --context 1048576 --method magicpig:2048:dense_layers=0 --kv-dtype bf16 --vram-budget 24GiB --steps 2 --warmup 1 --json > $OUT/v-ncu.csv 2> $OUT/v.err; echo "ncu rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/v.err | cut -c1-300
python3 - <<PY
import csv, collections
rows=[r for r in csv.reader(l for l in open("$OUT/v-ncu.csv") if l.startswith("\""))]
hdr=rows[0]; hdr=[h.strip('"') for h in hdr]; ki=hdr.index('Kernel Name'); vi=hdr.index('Metric Value'); gi=hdr.index('Grid Size') if 'Grid Size' in hdr else None
agg=collections.defaultdict(list)
for r in rows[1:]:
    try: agg[(r[ki][:40], r[gi] if gi else '')].append(float(r[vi].replace(',','')))
    except: pass
for k,v in sorted(agg.items()): print('%-42s %-16s n=%3d mean %8.1f us  sum %8.1f us' % (k[0],k[1],len(v),sum(v)/len(v)/1e3,sum(v)/1e3))
PY
