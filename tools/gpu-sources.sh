#!/usr/bin/env bash
# Sources that point at the fact, on the GPU machine (issue #44): `folio eval sources` at 100k
# and 1M tokens of the demo model, dense, HiP and MagicPIG, passages found by copies (what the
# window shows) and by attention mass alone, on the same context. Run after
#   cargo build -p folio --no-default-features --features cuda
#   mkdir -p .gpu && cp $CARGO_TARGET_DIR/debug/folio .gpu/ && strip .gpu/folio && xz .gpu/folio
# with the device tool: bash tools/gpu-sources.sh [LENGTHS...] (default: 100k 1M).
set -euo pipefail
out=${OUT:-/tmp/gpu-sources}
mkdir -p "$out" /tmp/folio-sources
[ -x .gpu/folio ] || xz -dk .gpu/folio.xz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
lengths=("$@")
[ ${#lengths[@]} -gt 0 ] || lengths=(100k 1M)
for length in "${lengths[@]}"; do
  for weighing in copied mass; do
    echo "== $length, passages by $weighing"
    .gpu/folio eval sources --model assets/models/demo --device cuda --length "$length" --weighing "$weighing" \
      --context "/tmp/folio-sources/$length.folio" --out "$out/$length-$weighing" 2>&1 | tee "$out/$length-$weighing.log" || true
  done
done
