#!/bin/bash
# Issue 13's CPU check: the simulator's predicted step time against the measured one,
# on the CPU backend, for four configurations (two resident, two planned under a
# device budget). Each configuration runs REPEATS times with `spillway bench train`
# after the cores have been idle (another process on a shared box skews a run);
# the table gives the median measured step, the prediction and the error.
#
#   scripts/cpu-predictions.sh                       # the cpu preset
#   MACHINE=/tmp/m.json scripts/cpu-predictions.sh   # a fresh `spillway profile`
#   PROFILE=1 scripts/cpu-predictions.sh             # profile first, then check it
#
# Environment: BIN (default build/spillway), MACHINE (cpu), REPEATS (3), STEPS (4),
# THREADS (2), PROFILE (0), PROFILE_OUT (where the profile is kept; default: removed).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/spillway}
MACHINE=${MACHINE:-cpu}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-4}
THREADS=${THREADS:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Waits until the cores were at least 90% idle over 3 s (at most 120 s).
wait_for_quiet() {
  for _ in $(seq 40); do
    read -r _ u n s i w _ < /proc/stat
    sleep 3
    read -r _ u2 n2 s2 i2 w2 _ < /proc/stat
    local busy=$(( (u2 + n2 + s2) - (u + n + s) )) idle=$(( (i2 + w2) - (i + w) ))
    if (( idle * 10 >= (busy + idle) * 9 )); then return 0; fi
  done
  echo "cpu-predictions: the cores did not go quiet in 120 s; measuring anyway" >&2
}

if [[ "${PROFILE:-0}" == 1 ]]; then
  mkdir -p "$work/spill"
  wait_for_quiet
  MACHINE=${PROFILE_OUT:-$work/machine.json}
  "$BIN" profile --backend cpu --threads "$THREADS" --spill-dir "$work/spill" --out "$MACHINE"
fi

configs=(
  "gpt2-124m 1x128 resident|--model gpt2-124m --batch 1 --context 128 --policy resident"
  "gpt2-124m 1x128 planned 200MiB|--model gpt2-124m --batch 1 --context 128 --device-budget 200MiB --policy planned"
  "tiny 8x128 accum 2 resident|--model tiny --batch 8 --context 128 --accum 2 --policy resident"
  "tiny 8x128 accum 2 planned 8MiB|--model tiny --batch 8 --context 128 --accum 2 --device-budget 8MiB --policy planned"
)
echo "machine: $MACHINE; $REPEATS runs of $STEPS steps each (the first a warm-up), $THREADS threads"
rows=()
for c in "${configs[@]}"; do
  name=${c%%|*}
  args=${c#*|}
  for r in $(seq "$REPEATS"); do
    wait_for_quiet
    # shellcheck disable=SC2086
    "$BIN" bench train --backend cpu --threads "$THREADS" --steps "$STEPS" --machine "$MACHINE" $args \
      --json "$work/run.json" > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
    grep -E "^predicted" "$work/run.log" | sed "s/^/  $name, run $r: /"
    rows+=("$name|$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["step_s"], j["predicted_step_s"])' "$work/run.json")")
  done
done
python3 - "${rows[@]}" <<'PY'
import sys, statistics
runs = {}
for row in sys.argv[1:]:
    name, figures = row.split("|")
    measured, predicted = map(float, figures.split())
    runs.setdefault(name, []).append((measured, predicted))
print(f"\n| configuration | measured (median) | predicted | error |\n| --- | ---: | ---: | ---: |")
for name, r in runs.items():
    measured = statistics.median(m for m, _ in r)
    predicted = statistics.median(p for _, p in r)
    print(f"| {name} | {measured:.4f} s | {predicted:.4f} s | {100 * (predicted / measured - 1):+.1f}% |")
PY
