#!/usr/bin/env bash
# Reproduces assets/models/demo: three seeded stages of tools/train_demo.py, 735 s of training in
# all on one NVIDIA H200 (docs/demo-model.md, "How it was trained"). Run on the GPU machine:
#
#   bash tools/train_demo_shipped.sh OUT_DIR
#
# OUT_DIR/run1: from scratch, the run-1 recipe (256 -> 4k tokens);
# OUT_DIR/ftB:  run 1 fine-tuned on 4k and 8k sequences, same recipe;
# OUT_DIR/ftD:  ftB fine-tuned on 8k and 16k sequences of recipe run5 (5-digit values, decoys),
#               then evaluated: the folder to ship.
set -euo pipefail
out=$(realpath -m "${1:?usage: tools/train_demo_shipped.sh OUT_DIR}")
cd "$(dirname "$0")"
python3 train_demo.py --out "$out/run1" --seed 1234 --steps 14000 --eval-tasks none
python3 train_demo.py --out "$out/ftB" --init "$out/run1" --recipe run1 --curriculum 4096:0.4,8192:0.6 \
  --steps 5000 --seed 4321 --lr 5e-4 --warmup 100 --eval-tasks none
python3 train_demo.py --out "$out/ftD" --init "$out/ftB" --recipe run5 --curriculum 8192:0.5,16384:0.5 \
  --steps 4000 --seed 5678 --lr 4e-4 --warmup 100 \
  --eval-lengths 32768,131072 --eval-samples 4 --eval-tasks needle --eval-1m 2 --eval-time-limit 200
