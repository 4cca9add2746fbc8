#!/usr/bin/env bash
# One call on the lent H200 for issue 11 (checkpoints): build; on CUDA, a run
# stopped with --stop-after and resumed gives the uninterrupted run's losses and
# weights; then the overhead of background checkpoints every 50 steps of
# gpt2-1.5b under a 24 GiB budget: bench train with and without them, same call.
# Usage (device tool, carry .deps): scripts/device-checkpoint.sh   (results in $OUT)
# STEPS (default 141: checkpoints after steps 50 and 100; the second write ends before the
# last step at 0.27 s a step, so no write runs past the steps, as in a long run).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
ck=/tmp/spillway-ckpt; rm -rf $ck; mkdir -p $ck
common="--backend cuda --model gpt2-124m --batch 4 --context 256 --steps 12 --eval-every 0 --device-budget 600MiB --policy planned"
$bin train $common --metrics "$out/straight.jsonl" --save $ck/straight.safetensors > "$out/resume.log" 2>&1
$bin train $common --metrics "$out/first.jsonl" --checkpoint-dir $ck/run --checkpoint-every 3 --stop-after 7 >> "$out/resume.log" 2>&1
$bin train --resume $ck/run --backend cuda --device-budget 900MiB --metrics "$out/second.jsonl" --save $ck/resumed.safetensors >> "$out/resume.log" 2>&1
cat "$out/first.jsonl" "$out/second.jsonl" > "$out/joined.jsonl"
scripts/same_losses.py "cuda resume (stop after 7 at 600 MiB, resume at 900 MiB)" "$out/straight.jsonl" "$out/joined.jsonl" | tee -a "$out/summary.txt"
if cmp -s $ck/straight.safetensors $ck/resumed.safetensors; then log "saved weights identical"; else log "saved weights DIFFER"; fi
grep -h "checkpoint" "$out/resume.log" | tail -3 | tee -a "$out/summary.txt"
# Resident (the whole state on device): the background checkpoint of step 6 is copied
# straight into pinned memory while steps 7.. run. Resume from it (the final one of
# step 7 removed) and compare with the uninterrupted run.
rcommon="--backend cuda --model gpt2-124m --batch 4 --context 256 --steps 12 --eval-every 0"
$bin train $rcommon --metrics "$out/r_straight.jsonl" --save $ck/r_straight.safetensors > "$out/rresume.log" 2>&1
$bin train $rcommon --metrics "$out/r_first.jsonl" --checkpoint-dir $ck/rrun --checkpoint-every 3 --keep 3 --stop-after 7 >> "$out/rresume.log" 2>&1
rm -rf $ck/rrun/ckpt-00000007
$bin train --resume $ck/rrun --backend cuda --metrics "$out/r_second.jsonl" --save $ck/r_resumed.safetensors >> "$out/rresume.log" 2>&1
head -6 "$out/r_first.jsonl" > "$out/r_joined.jsonl"; cat "$out/r_second.jsonl" >> "$out/r_joined.jsonl"
scripts/same_losses.py "cuda resident, resumed from the pinned background checkpoint of step 6" "$out/r_straight.jsonl" "$out/r_joined.jsonl" | tee -a "$out/summary.txt"
if cmp -s $ck/r_straight.safetensors $ck/r_resumed.safetensors; then log "resident: saved weights identical"; else log "resident: saved weights DIFFER"; fi
steps=${STEPS:-141}
for mode in plain ckpt; do
  extra=""; [ $mode = ckpt ] && extra="--checkpoint-dir $ck/bench --checkpoint-every 50"
  log "gpt2-1.5b 24 GiB accum 1, $steps steps, $mode"
  timeout 400 $bin bench train --backend cuda --model gpt2-1.5b --batch 8 --accum 1 --steps $steps --device-budget 24GiB \
    --policy planned $extra --json "$out/b_$mode.json" > "$out/b_$mode.log" 2>&1 || tail -5 "$out/b_$mode.log"
  grep -E "^(tokens/s|step time|checkpoints|first step|checkpoint of step)" "$out/b_$mode.log" | tee -a "$out/summary.txt"
  grep -E "^step (50|51|52|100|101|102):" "$out/b_$mode.log" | tee -a "$out/summary.txt"
done
df -h /tmp | tail -1 | tee -a "$out/summary.txt"
rm -rf $ck
python3 - "$out" "$steps" <<'PY' | tee -a "$out/summary.txt"
import json, sys
o, timed = sys.argv[1], int(sys.argv[2]) - 1
p, c = json.load(open(o + "/b_plain.json")), json.load(open(o + "/b_ckpt.json"))
extra = (c["step_s"] - p["step_s"]) * timed / max(1, c["checkpoints"])  # seconds per checkpoint
print(f"plain {p['step_s']:.4f} s/step, with checkpoints {c['step_s']:.4f} s/step ({c['checkpoints']} checkpoints, "
      f"snapshot waits {c['checkpoint_wait_s']:.2f} s); per checkpoint {extra:.2f} s = "
      f"{100*extra/(50*p['step_s']):.1f}% of 50 steps")
PY
