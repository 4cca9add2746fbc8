#!/usr/bin/env bash
# One call on the lent H200: the resident training table of issue 5 — Spillway's
# `bench train --backend cuda --profile` for GPT-2 124M..2.7B at context 1024, then
# the PyTorch peer (eager, bf16 autocast, SDPA, fused AdamW) on the same sizes, so
# the comparison is a ratio from one machine and one call.
# Usage (device tool, carry .deps): scripts/device-train-table.sh [models...]  (results in $OUT)
# NO_PEER=1 skips the PyTorch peer; SKIP_BUILD=1 reuses build-device/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  log "build $(( $(date +%s) - t0 )) s"
fi
bin=build-device/spillway
models=${*:-"gpt2-124m:16 gpt2-350m:16 gpt2-774m:8 gpt2-1.5b:8 gpt-2.7b:8"}
peers=""
for mb in $models; do
  m=${mb%%:*}; b=${mb##*:}
  timeout 240 $bin bench train --backend cuda --model "$m" --batch "$b" --steps 4 --profile > "$out/spillway_$m.txt" 2>&1
  echo "$m B=$b: $(grep -E '^(tokens/s|MFU|host issue)' "$out/spillway_$m.txt" | tr -s ' ' | tr '\n' ';')" | tee -a "$out/summary.txt"
  case $m in gpt2-124m) p=124M;; gpt2-350m) p=350M;; gpt2-774m) p=774M;; gpt2-1.5b) p=1.5B;; gpt-2.7b) p=2.7B;; esac
  peers="$peers $p:full:$b"
done
[ "${NO_PEER:-0}" = 1 ] && peers=""
[ -n "$peers" ] && log "PyTorch peer"
[ -n "$peers" ] && NMEAS=3 timeout 300 python3 bench/peers/torch_gpt.py $peers 2>&1 | tee "$out/torch.jsonl" | cut -c1-200 | tee -a "$out/summary.txt"
log "time splits"
for f in "$out"/spillway_*.txt; do echo "-- $f"; sed -n '/^time split/,$p' "$f"; done | tee -a "$out/summary.txt"
log "total $(( $(date +%s) - t0 )) s"
