#!/usr/bin/env bash
# Why does the yardstick's 24-layer shape learn retrieval so slowly (docs/yardstick.md, first
# runs)? Four 1,000-step runs on the demo's own data (recipe run1, 256 and 512 tokens), each
# changing one thing from the yardstick's shape, scored per task on held-out sequences; the
# 4-layer demo reached loss 0.072 by step 1,000 on this data, the 24-layer yardstick 0.72.
# Run on the GPU machine (about 8 minutes on one H200); logs go to OUT_DIR/NAME/train.log:
#
#   bash tools/yardstick_ablation.sh OUT_DIR
#
#   depth4     the yardstick's width and grouping at 4 layers (depth alone)
#   mha        24 layers, one K/V head per query head (the grouping alone)
#   resinit    24 layers, o_proj/down_proj initialised at 0.02/sqrt(48) (the initialisation)
#   lr3e-4     24 layers at a fifth of the demo's learning rate (the step size)
set -euo pipefail
out=$(realpath -m "${1:?usage: tools/yardstick_ablation.sh OUT_DIR}")
cd "$(dirname "$0")"
run() {
  local name=$1
  shift
  python3 train_demo.py --model yardstick --recipe run1 --out "$out/$name" --seed 1234 --steps 1000 \
    --curriculum 256:0.5,512:0.5 --warmup 100 --eval-tasks none --task-eval-lengths 512 \
    --task-eval-samples 32 "$@" > /dev/null 2>&1 || echo "$name failed: see $out/$name/train.log"
  echo "$name: $(grep -E 'step 1000/' "$out/$name/train.log" | sed 's/.*loss/loss/') | $(grep -E 'task scores' "$out/$name/train.log" | sed 's/.*forced): //')"
}
run depth4 --shape layers=4
run mha --shape kv_heads=7
run resinit --residual-init
run lr3e-4 --lr 3e-4
