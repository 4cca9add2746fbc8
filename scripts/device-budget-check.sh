#!/usr/bin/env bash
# One call on the lent H200 for issue 9: build, CUDA op tests, exactness under
# budgets (evaluation included), a diverging run, and the process's device memory
# beyond the CUDA context (cudaMemGetInfo) against --device-budget at 24 GiB.
# Usage (device tool, carry .deps): scripts/device-budget-check.sh   (results in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway test_backend > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
timeout 150 build-device/test_backend --gtest_filter='CudaOps.*' > "$out/cuda_ops.log" 2>&1
log "CUDA op tests: $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/cuda_ops.log" | tr '\n' ' ')"
grep -E "Failure|FAILED" -A4 "$out/cuda_ops.log" | head -30
# Exactness with evaluation inside the budget: resident vs planned/paging at 6 MiB.
$bin train --backend cuda --model tiny --steps 30 --batch 8 --eval-every 10 --metrics "$out/tiny_resident.jsonl" --quiet > "$out/exact.log" 2>&1
for p in planned paging; do
  $bin train --backend cuda --model tiny --steps 30 --batch 8 --eval-every 10 --device-budget 40MiB --policy $p \
    --metrics "$out/tiny_$p.jsonl" --quiet >> "$out/exact.log" 2>&1 || tail -3 "$out/exact.log"
done
scripts/same_losses.py "cuda exactness, tiny, eval every 10" "$out/tiny_resident.jsonl" "$out/tiny_planned.jsonl" "$out/tiny_paging.jsonl" | tee -a "$out/summary.txt"
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json,sys
out=sys.argv[1]
v={p:[json.loads(l).get("val_loss") for l in open(f"{out}/tiny_{p}.jsonl") if "val_loss" in l] for p in ["resident","planned","paging"]}
print("val losses equal:", v["resident"]==v["planned"]==v["paging"], v["resident"])
PY
log "diverging run (--lr 1e30) stops with an error"
$bin train --backend cuda --model tiny --steps 5 --batch 8 --eval-every 0 --lr 1e30 --quiet --save /tmp/d.safetensors > "$out/diverge.log" 2>&1; echo "exit $?" | tee -a "$out/summary.txt"
tail -2 "$out/diverge.log" | tee -a "$out/summary.txt"
for m in "gpt2-1.5b --accum 1" "gpt2-1.5b --accum 4" "gpt-2.7b --accum 1"; do
  log "24 GiB budget: $m (planned)"
  timeout 170 $bin bench train --backend cuda --model $m --batch 8 --steps 3 --device-budget 24GiB --policy planned \
    --json "$out/b24_${m// /_}.json" 2>&1 | tail -6 | tee -a "$out/summary.txt"
done
log "resident gpt2-124m, batch 16"
timeout 90 $bin bench train --backend cuda --model gpt2-124m --batch 16 --steps 4 --json "$out/r124.json" 2>&1 | tail -4 | tee -a "$out/summary.txt"
log "total $(( $(date +%s) - t0 )) s"
