#!/usr/bin/env bash
# Reproduces assets/models/demo: four seeded stages of tools/train_demo.py, 978 s of training in
# all (stages 1-3 on one NVIDIA H200, stage 4 on one H100; docs/demo-model.md, "How it was
# trained"). Run on the GPU machine:
#
#   bash tools/train_demo_shipped.sh OUT_DIR
#
# OUT_DIR/run1: from scratch, the run-1 recipe (256 -> 4k tokens);
# OUT_DIR/ftB:  run 1 fine-tuned on 4k and 8k sequences, same recipe;
# OUT_DIR/ftD:  ftB fine-tuned on 8k and 16k sequences of recipe run5 (5-digit values, decoys);
# OUT_DIR/ftE:  ftD fine-tuned on 16k and 32k sequences of recipe run6 (other facts beside the
#               pass key), then evaluated: the folder to ship.
set -euo pipefail
out=$(realpath -m "${1:?usage: tools/train_demo_shipped.sh OUT_DIR}")
cd "$(dirname "$0")"
python3 train_demo.py --out "$out/run1" --seed 1234 --steps 14000 --eval-tasks none
python3 train_demo.py --out "$out/ftB" --init "$out/run1" --recipe run1 --curriculum 4096:0.4,8192:0.6 \
  --steps 5000 --seed 4321 --lr 5e-4 --warmup 100 --eval-tasks none
python3 train_demo.py --out "$out/ftD" --init "$out/ftB" --recipe run5 --curriculum 8192:0.5,16384:0.5 \
  --steps 4000 --seed 5678 --lr 4e-4 --warmup 100 --eval-tasks none
python3 train_demo.py --out "$out/ftE" --init "$out/ftD" --recipe run6 --curriculum 16384:0.4,32768:0.6 \
  --steps 3000 --seed 6789 --lr 3e-4 --warmup 100 \
  --eval-lengths 32768 --eval-samples 4 --eval-tasks needle,passkey --eval-1m 2 --eval-time-limit 150
