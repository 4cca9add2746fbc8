#!/usr/bin/env bash
# The main job behind `make run`: trains the tiny model on the bundled corpus under
# a device budget of 16 MiB, about a third of the 50.7 MiB that the step needs with
# everything resident (`spillway plan --model tiny --machine cpu --batch 16
# --context 64 --policy resident`), so the planned policy streams parameters,
# keeps the optimizer state on host and recomputes some activations. Then it saves
# the weights and prints a sample from them.
#
#   scripts/main-job.sh build/spillway
set -euo pipefail
bin=${1:-build/spillway}
out=$(dirname "$bin")
weights="$out/tiny.safetensors"
metrics="$out/tiny-metrics.jsonl"

info=$("$bin" info)
echo "$info"
echo
# On a GPU every plan also holds the 32 MiB cuBLASLt workspace inside the budget:
# 16 MiB for the tensors plus that.
budget=16MiB
if echo "$info" | grep -qE '^  cuda +[^ u]'; then budget=48MiB; fi
"$bin" train --model tiny --steps 500 --batch 16 --context 64 --warmup 20 \
  --eval-every 100 --eval-batches 20 \
  --policy planned --device-budget $budget \
  --metrics "$metrics" --save "$weights"
echo
echo "per-step metrics: $metrics"
echo "sample from $weights:"
echo "----"
"$bin" sample --load "$weights" --prompt "ROMEO:" --tokens 300 --temperature 0.8 --seed 1 --context 64
echo "----"
