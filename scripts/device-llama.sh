#!/usr/bin/env bash
# One call on the lent H200 for issue 12 (Llama models): build; the CUDA op tests
# (RoPE, SwiGLU, grouped-query attention, and every other op, since attention
# changed); transformers' reference losses and gradients on CUDA in bf16; then
# tokens/s of llama-3.2-1b and llama-3.2-3b with no budget against the PyTorch peer
# (bench/peers/torch_llama.py, same call), and llama-3.1-8b under a 24 GiB device
# budget with part of its state in storage.
# Usage (device tool, carry .deps): PART=all|tests|speed|8b scripts/device-llama.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
part=${PART:-all}
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_backend test_train > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
if [ "$part" = all ] || [ "$part" = tests ]; then
  build-device/test_backend --gtest_filter='CudaOps.*' > "$out/cuda_ops.log" 2>&1
  log "test_backend CudaOps: $(grep -E '^\[  (PASSED|FAILED) ' "$out/cuda_ops.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure" "$out/cuda_ops.log" | head -20 | tee -a "$out/summary.txt"
  build-device/test_train --gtest_filter='Transformers/*:CudaBudget.*' > "$out/cuda_train.log" 2>&1
  log "test_train Transformers+CudaBudget: $(grep -E '^\[  (PASSED|FAILED) ' "$out/cuda_train.log" | tr '\n' ' ')"
  grep -E " on (cpu|cuda): loss|^\[  FAILED|Failure" "$out/cuda_train.log" | head -20 | tee -a "$out/summary.txt"
fi
if [ "$part" = all ] || [ "$part" = speed ]; then
  for m in llama-3.2-1b llama-3.2-3b; do
    log "$m no budget, batch 8, context 1024"
    timeout 300 $bin bench train --backend cuda --model $m --batch 8 --context 1024 --accum 1 --steps 4 \
      --policy resident --json "$out/s_$m.json" > "$out/s_$m.log" 2>&1 || tail -5 "$out/s_$m.log"
    grep -E "^(tokens/s|step time|mfu|MFU|first step|time to first)" "$out/s_$m.log" | tee -a "$out/summary.txt"
    NMEAS=4 timeout 300 python3 bench/peers/torch_llama.py $m:full:8 > "$out/p_$m.json" 2> "$out/p_$m.err"
    cat "$out/p_$m.json" | tee -a "$out/summary.txt"
  done
fi
if [ "$part" = all ] || [ "$part" = 8b ]; then
  spill=/tmp/spillway-spill; rm -rf $spill; mkdir -p $spill
  df -h /tmp | tail -1 | tee -a "$out/summary.txt"
  free -g | head -2 | tee -a "$out/summary.txt"
  log "llama-3.1-8b at 24 GiB, host 100 GiB, storage in $spill"
  timeout 420 $bin bench train --backend cuda --model llama-3.1-8b --batch 8 --context 1024 --accum 1 --steps 2 \
    --device-budget 24GiB --host-budget 100GiB --spill-dir $spill --storage-budget 100GiB --policy planned \
    --json "$out/s_8b.json" > "$out/s_8b.log" 2>&1 || tail -5 "$out/s_8b.log"
  tail -30 "$out/s_8b.log" | tee -a "$out/summary.txt"
  rm -rf $spill
fi
log "total $(( $(date +%s) - t0 )) s"
