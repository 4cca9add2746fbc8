#!/usr/bin/env bash
# One call on the lent GPU for issue 10's time to the first step: builds spillway and
# test_backend, runs the pinned-memory tests (or the test_backend filter TESTS), then
# `bench train --policy auto` on RUN (model:accum:budget:flags, flags with '+' for
# spaces; default gpt-2.7b at accum 4 under 24 GiB without clipping) once for each
# value of SPILLWAY_CUDA_PINNED_REGISTER in PINNED (default "0 1": cudaHostAlloc, then
# huge pages faulted in parallel and registered), and last PyTorch's initialization of
# the same model (PEER, a bench/peers/torch_gpt.py configuration; default
# 2.7B:full:8). Prints each run's time to the first step with its parts, and its
# tokens/s.
# Usage (device tool, carry .deps): scripts/device-first-step.sh   (summary in $OUT/summary.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/first-step-logs
log() { echo "$*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
machine=machines/h100.json
[[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]] && machine=machines/h200.json
scripts/device-build.sh spillway test_backend > /tmp/first-step-logs/build.log 2>&1 ||
  { tail -40 /tmp/first-step-logs/build.log; exit 1; }
log "build $(( $(date +%s) - t0 )) s ($machine)"
timeout 180 build-device/test_backend --gtest_filter="${TESTS:-CudaOps.RegisteredPinned*:CudaOps.CopyEngineOrdering}" \
  > /tmp/first-step-logs/tests.log 2>&1
log "tests ${TESTS:-CudaOps.RegisteredPinned*:CudaOps.CopyEngineOrdering}: rc $? $(grep -E '^\[  (PASSED|FAILED)' /tmp/first-step-logs/tests.log | tr '\n' ' ')"
grep -E 'Failure' -A4 /tmp/first-step-logs/tests.log | head -20 | tee -a "$out/summary.txt"
IFS=: read -r m a budget flags <<< "${RUN:-gpt-2.7b:4:24GiB:--grad-clip+0}"; flags=${flags//+/ }
for v in ${PINNED:-0 1}; do
  f=/tmp/first-step-logs/train_pinned$v.log
  # shellcheck disable=SC2086
  SPILLWAY_CUDA_PINNED_REGISTER=$v timeout 240 build-device/spillway bench train --backend cuda --model "$m" \
    --accum "$a" --batch 8 --steps 4 --device-budget "$budget" --policy auto --machine $machine $flags > "$f" 2>&1
  log "SPILLWAY_CUDA_PINNED_REGISTER=$v $m accum $a $budget [$flags]: rc $?"
  { grep -oE "timed one step each:.*" "$f" | cut -c1-700
    grep -E "^first step|tokens/s|^own steps|^predicted|rror" "$f" | cut -c1-300; } | tee -a "$out/summary.txt"
done
log "peer ${PEER:-2.7B:full:8}: $(NMEAS=2 timeout 240 python3 bench/peers/torch_gpt.py "${PEER:-2.7B:full:8}" 2>&1 | tail -1)"
tar -czf "$out/first-step-logs.tar.gz" -C /tmp first-step-logs
log "done $(( $(date +%s) - t0 )) s"
