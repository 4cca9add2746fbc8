#!/usr/bin/env bash
# One call on the lent H200 for issue 14's multi-tensor optimizer: the CUDA op tests
# (per-tensor against multi-tensor bit for bit, against the host AdamW, flush order,
# launch counts), end-to-end bits with and without batching (losses and saved
# weights), then resident tokens/s with and without it beside PyTorch eager and
# torch.compile in the same call. Usage (device tool, carry .deps): scripts/device-multi.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_backend > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
timeout 200 build-device/test_backend --gtest_filter='CudaOps.*:CudaBudget.*' > "$out/cuda_ops.log" 2>&1
log "CUDA op tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/cuda_ops.log" | tr '\n' ' ')"
grep -E "Failure|FAILED|launches" -A3 "$out/cuda_ops.log" | head -40 | tee -a "$out/summary.txt"
e2e="--backend cuda --model gpt2-124m --context 256 --batch 4 --steps 6 --eval-every 0 --lr 3e-3 --warmup 0 --quiet"
SPILLWAY_CUDA_MULTI_TENSOR=0 $bin train $e2e --metrics "$out/per.jsonl" --save /tmp/per.safetensors > "$out/e2e.log" 2>&1
$bin train $e2e --metrics "$out/multi.jsonl" --save /tmp/multi.safetensors >> "$out/e2e.log" 2>&1
scripts/same_losses.py "per-tensor against multi-tensor optimizer, gpt2-124m" "$out/per.jsonl" "$out/multi.jsonl" | tee -a "$out/summary.txt"
if cmp -s /tmp/per.safetensors /tmp/multi.safetensors; then log "saved weights identical"; else log "saved weights DIFFER"; fi
for spec in "gpt2-124m 16" "gpt2-1.5b 8"; do
  set -- $spec
  for mt in 0 1; do
    log "resident $1 batch $2, SPILLWAY_CUDA_MULTI_TENSOR=$mt"
    SPILLWAY_CUDA_MULTI_TENSOR=$mt timeout 120 $bin bench train --backend cuda --model $1 --batch $2 --steps 5 \
      > "$out/res_$1_$mt.log" 2>&1
    grep -E "^(tokens/s|step time|MFU)" "$out/res_$1_$mt.log" | tee -a "$out/summary.txt"
  done
done
log "PyTorch peers, same call"
NMEAS=4 timeout 240 python3 bench/peers/torch_gpt.py 124M:full:16 124M:compile:16 1.5B:full:8 1.5B:compile:8 2>&1 \
  | grep '^{' | python3 -c "import json,sys; [print(d['cfg'], d['tok_s'], 'tok/s') for d in map(json.loads, sys.stdin)]" \
  | tee -a "$out/summary.txt"
log "total $(( $(date +%s) - t0 )) s"
