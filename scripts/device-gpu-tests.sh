#!/usr/bin/env bash
# One part of a call on the lent H200: builds the CUDA test binaries and runs the GPU
# tests that CI cannot (it has no GPU): the CUDA ops against the CPU reference, the
# budgeted-against-resident CUDA runs, and data parallelism on the CUDA backend (two
# ranks in threads on one GPU against one rank's accumulation, bit for bit; NCCL with
# one rank), then `spillway launch --gpus 1` on tiny. FILTERS overrides the gtest
# filters (binary:filter ...). Summary in $OUT/summary.txt, logs in $OUT/gpu-tests.tar.gz.
# Usage (device tool, carry .deps): scripts/device-gpu-tests.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/gpu-tests
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_dist test_backend test_train > /tmp/gpu-tests/build.log 2>&1 ||
  { tail -40 /tmp/gpu-tests/build.log; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
for bf in ${FILTERS:-test_dist:CudaDataParallel.*:NcclCommunicator.*:Bf16*:ThreadCommunicator.* test_backend:CudaOps.* test_train:Transformers/*:CudaBudget.*}; do
  b=${bf%%:*}; f=${bf#*:}
  timeout 300 build-device/$b --gtest_filter="$f" > /tmp/gpu-tests/$b.log 2>&1
  echo "$b $f: rc $? $(grep -E '^\[  (PASSED|FAILED)|tests ran' /tmp/gpu-tests/$b.log | tr '\n' ' ')" | tee -a "$out/summary.txt"
  grep -E '^\[  FAILED' /tmp/gpu-tests/$b.log | head -10 | tee -a "$out/summary.txt"
done
log "launch --gpus 1 train --backend cuda --model tiny"
timeout 120 build-device/spillway launch --gpus 1 train --backend cuda --model tiny --steps 3 --eval-every 0 \
  > /tmp/gpu-tests/launch.log 2>&1; echo "rc $?" | tee -a "$out/summary.txt"
tail -4 /tmp/gpu-tests/launch.log | tee -a "$out/summary.txt"
tar -czf "$out/gpu-tests.tar.gz" -C /tmp gpu-tests
