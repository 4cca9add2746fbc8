#!/usr/bin/env bash
# One call on the lent H200: build, check exactness on CUDA, and time what
# bench/RESULTS.md records, Spillway and its PyTorch peer side by side.
# Usage (device tool, carry .deps): scripts/device-bench.sh   (results in $OUT)
# It needs about 6 device minutes with a warm build; run it early in a session.
# QUICK=1 stops after the correctness checks and the 24 GiB gpt2-1.5b run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_backend > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
mkdir -p /tmp/spill
timeout 120 build-device/test_backend --gtest_filter='CudaOps.*' > "$out/cuda_ops.log" 2>&1
log "CUDA op tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/cuda_ops.log" | tr '\n' ' ')"
grep -E "Failure|FAILED" -A4 "$out/cuda_ops.log" | head -40
# Exactness on CUDA: tiny resident vs planned/paging under a small budget, same seed.
$bin train --backend cuda --model tiny --steps 30 --batch 8 --eval-every 0 --metrics "$out/tiny_resident.jsonl" --quiet > "$out/exact.log" 2>&1
for p in planned paging; do
  $bin train --backend cuda --model tiny --steps 30 --batch 8 --eval-every 0 --device-budget 6MiB --policy $p \
    --metrics "$out/tiny_$p.jsonl" --quiet >> "$out/exact.log" 2>&1
done
scripts/same_losses.py "cuda exactness, tiny" "$out/tiny_resident.jsonl" "$out/tiny_planned.jsonl" "$out/tiny_paging.jsonl" | tee -a "$out/summary.txt"
# Vocab tiles on CUDA: a budget below the whole-table LM head builds it in tiles.
for b in unlimited 150MiB; do
  flags=""; [ "$b" != unlimited ] && flags="--device-budget $b --policy planned"
  $bin train --backend cuda --model gpt2-124m --context 128 --batch 2 --steps 5 --eval-every 0 $flags \
    --metrics "$out/tiles_$b.jsonl" --quiet >> "$out/exact.log" 2>&1
done
scripts/same_losses.py "cuda exactness, gpt2-124m vocab tiles" "$out/tiles_unlimited.jsonl" "$out/tiles_150MiB.jsonl" | tee -a "$out/summary.txt"
log "one gpt2-124m step against PyTorch: loss and every gradient"
gc=/tmp/gradcheck
BIN=$bin OUT=$out scripts/device-exactness.sh gradcheck "gpt2-124m" | tee -a "$out/summary.txt"
log "20 steps from the same weights, Spillway and PyTorch"
$bin train --backend cuda --data $gc/gc_train.bin --load $gc/init.safetensors --steps 20 --batch 4 --context 1024 \
  --eval-every 0 --quiet --metrics $gc/curve.jsonl > "$out/curve.log" 2>&1
python3 bench/peers/torch_gradient_check.py curve $gc --B 4 --T 1024 >> "$out/curve.log" 2>&1
tail -1 "$out/curve.log" | tee -a "$out/summary.txt"
log "24 GiB budget, gpt2-1.5b, planned"
timeout 150 $bin bench train --backend cuda --model gpt2-1.5b --batch 8 --accum 2 --steps 3 --device-budget 24GiB --policy planned 2>&1 | tee -a "$out/summary.txt"
[ "${QUICK:-0}" = 1 ] && { log "total $(( $(date +%s) - t0 )) s"; exit 0; }
log "copy and storage bandwidth"
timeout 60 $bin bench io --dir /tmp/spill --size 1GiB --engines uring,threads --depths 1,32 --backend cuda --copy-size 2GiB 2>&1 | tee -a "$out/summary.txt"
log "host AdamW"
timeout 60 $bin bench adam --params 5e8 --dtype bf16 2>&1 | tee -a "$out/summary.txt"
log "resident training, gpt2-124m"
timeout 90 $bin bench train --backend cuda --model gpt2-124m --batch 16 --steps 4 2>&1 | tee -a "$out/summary.txt"
log "ops at gpt2-124m shapes, Spillway then PyTorch"
timeout 60 $bin bench ops 2>&1 | tail -25 | tee -a "$out/summary.txt"
timeout 90 python3 bench/peers/torch_reference_step.py --no-step 2>&1 | tail -25 | tee -a "$out/summary.txt"
log "PyTorch peer training step, same machine"
NMEAS=3 timeout 120 python3 bench/peers/torch_gpt.py 124M:full:16 2>&1 | tail -2 | tee -a "$out/summary.txt"
log "total $(( $(date +%s) - t0 )) s"
