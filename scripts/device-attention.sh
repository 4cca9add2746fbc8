#!/usr/bin/env bash
# One call on the lent GPU for issue 14's attention kernels: builds, runs the CUDA
# attention tests (against the CPU reference, and the Hopper wgmma kernels against the
# mma.sync ones element by element), then times the attention rows of `spillway bench
# ops` with each kernel (SPILLWAY_CUDA_ATTENTION=auto|mma) beside PyTorch's SDPA
# (bench/peers/torch_attention.py) at the gpt2-124m, gpt2-1.5b and gpt-2.7b shapes.
# Stops after the tests when they fail. Usage (device tool, carry .deps):
#   scripts/device-attention.sh        (summary in $OUT/summary.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "$*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_backend > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
timeout 300 build-device/test_backend --gtest_filter='CudaOps.*Attention*' > "$out/attention-tests.log" 2>&1
rc=$?
log "CudaOps.*Attention*: rc $rc $(grep -E '^\[  (PASSED|FAILED)' "$out/attention-tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure' -A3 "$out/attention-tests.log" | head -30 | tee -a "$out/summary.txt"
[ "$rc" = 0 ] || exit 0
for shape in "16 768 12" "8 1600 25" "8 2560 32"; do
  set -- $shape
  for k in auto mma; do
    r=$(SPILLWAY_CUDA_ATTENTION=$k timeout 120 build-device/spillway bench ops --backend cuda --B "$1" --T 1024 \
      --C "$2" --NH "$3" --V 50304 2>&1 | grep -E '^attention' | tr -s ' ' | tr '\n' ';')
    log "ours B=$1 C=$2 NH=$3 SPILLWAY_CUDA_ATTENTION=$k: $r"
  done
done
timeout 180 python3 bench/peers/torch_attention.py 16:1024:12:64 8:1024:25:64 8:1024:32:80 2>&1 |
  tee -a "$out/summary.txt"
log "done $(( $(date +%s) - t0 )) s"
