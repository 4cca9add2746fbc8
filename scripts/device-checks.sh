#!/usr/bin/env bash
# The remaining device checks of issues 12, 10 and 13 in one call on the lent H200,
# most needed first, each writing into $OUT as it finishes (a call cut short still
# returns what ran):
#   1. issue 12: transformers' from_pretrained loads directories that `spillway train
#      --save DIR` wrote on CUDA (tied llama-tiny, untied llama-tiny, gpt2 tiny);
#   2. issue 10: gpt2-1.5b at 24 GiB against the resident run (accum 1, or $ACCUMS),
#      5 steps with clipping active in some, losses and saved weights bit for bit;
#   3. issue 13: `spillway profile`; the plan of gpt2-1.5b at 24 GiB accum 1 with the
#      preset and the measured machine; then policy auto on the measured machine,
#      which times its best two candidates (predicted beside measured) and runs.
# Usage (device tool, carry .deps): scripts/device-checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway

# 1. Hugging Face directories written on CUDA, loaded by transformers.
for m in "llama-tiny" "llama-tiny --untied" "tiny"; do
  d=/tmp/hf_${m// /_}; rm -rf "$d"
  $bin train --backend cuda --model $m --steps 2 --batch 4 --save "$d" --quiet > "$out/hf_${m// /_}.log" 2>&1 ||
    tail -3 "$out/hf_${m// /_}.log"
  log "from_pretrained, $m: $(python3 bench/peers/hf_load_check.py "$d" 2>&1 | tail -1)"
done

# 2. gpt2-1.5b at 24 GiB against resident, losses and saved weights.
for a in ${ACCUMS:-1}; do
  for b in resident 24GiB; do
    flags=""; [ $b = resident ] || flags="--device-budget $b --policy planned"
    timeout 120 $bin train --backend cuda --model gpt2-1.5b --batch 8 --context 1024 --accum $a --steps 5 --lr 3e-3 \
      --warmup 0 --eval-every 0 $flags --metrics "$out/xl_${b}_$a.jsonl" --save /tmp/xl_${b}_$a.safetensors \
      > "$out/xl_${b}_$a.log" 2>&1 || tail -3 "$out/xl_${b}_$a.log"
  done
  grep "plan:" "$out/xl_24GiB_$a.log" | tee -a "$out/summary.txt"
  scripts/same_losses.py "cuda exactness, gpt2-1.5b accum $a, 24 GiB" "$out/xl_resident_$a.jsonl" "$out/xl_24GiB_$a.jsonl" |
    tee -a "$out/summary.txt"
  if cmp -s /tmp/xl_resident_$a.safetensors /tmp/xl_24GiB_$a.safetensors; then log "saved weights, accum $a: identical"
  else log "saved weights, accum $a: DIFFER ($(ls -l /tmp/xl_*_$a.safetensors 2>&1 | awk '{print $5}' | tr '\n' ' '))"; fi
  python3 -c "import json,sys; print('grad norms:', [round(json.loads(l)['grad_norm'],3) for l in open(sys.argv[1]) if 'grad_norm' in l])" \
    "$out/xl_24GiB_$a.jsonl" | tee -a "$out/summary.txt"
  rm -f /tmp/xl_*_$a.safetensors
done

# 3. The measured machine, predictions beside measurements, and auto's confirmation.
mkdir -p /tmp/spill
timeout 120 $bin profile --backend cuda --spill-dir /tmp/spill --out "$out/h200-measured.json" > "$out/profile.txt" 2>&1
tail -25 "$out/profile.txt" | tee -a "$out/summary.txt"
for m in h200 "$out/h200-measured.json"; do
  log "plan gpt2-1.5b, 24 GiB, accum 1, machine $m"
  timeout 60 $bin simulate --machine "$m" --model gpt2-1.5b --batch 8 --accum 1 --device-budget 24GiB --policy planned 2>&1 |
    tail -4 | tee -a "$out/summary.txt"
done
log "measured: policy auto on the measured machine (times its best two candidates first)"
timeout 180 $bin bench train --backend cuda --model gpt2-1.5b --batch 8 --accum 1 --steps 3 --device-budget 24GiB \
  --policy auto --machine "$out/h200-measured.json" > "$out/bench_auto.log" 2>&1
grep -E "plan:|tokens/s|GPU stalled|executor waits|first step|MFU|predicted" "$out/bench_auto.log" | tee -a "$out/summary.txt"
log "total $(( $(date +%s) - t0 )) s"
