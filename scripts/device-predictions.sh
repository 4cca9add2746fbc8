#!/usr/bin/env bash
# One call on the lent H200 for issue 13's table: predicted against measured step times.
# Builds (unless SKIP_BUILD=1), then for each RUNS entry model:accum:budget:flags
# (flags with '+' for spaces) runs `spillway bench train --backend cuda --batch 8
# --steps 4 --policy $POLICY --machine $MACHINE` and prints the bench's predicted and
# measured figures; last, one line per run: model, accum, budget, flags, predicted step,
# own steps (the mean of the step calls), error. MACHINE: the planner's machine (default
# h200; a profile's file for a measured one). POLICY: planned (default) or auto.
# DEADLINE (seconds since the epoch): runs that would start after it are skipped, and
# a run is stopped RUN_GRACE (120) seconds after it.
# Logs in $OUT/pred-logs.tar.gz.
# Usage (device tool, carry .deps): RUNS="gpt2-1.5b:1:24GiB: gpt-4b:1:24GiB:--grad-clip+0" \
#   scripts/device-predictions.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/pred-logs /tmp/spill
log() { echo "== $*" | tee -a "$out/summary.txt"; }
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  scripts/device-build.sh spillway > /tmp/pred-logs/build.log 2>&1 || { tail -40 /tmp/pred-logs/build.log; exit 1; }
fi
bin=build-device/spillway
table=/tmp/pred-logs/table.txt; : > "$table"
for r in ${RUNS:-gpt2-1.5b:1:24GiB: gpt2-1.5b:4:24GiB: gpt-2.7b:1:24GiB: gpt-2.7b:4:40GiB:}; do
  IFS=: read -r m a budget flags <<< "$r"; flags=${flags//+/ }
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "$m $a $budget [$flags] skipped: past the deadline" >> "$table"; continue
  fi
  name=pred_${m}_${a}_${budget}_$(echo "$flags" | tr -c 'a-z0-9\n' '_')
  log "$m accum $a, $budget $flags"
  lim=240  # a run may go past DEADLINE by at most RUN_GRACE seconds (default 120)
  if [ -n "${DEADLINE:-}" ]; then
    rem=$((DEADLINE + ${RUN_GRACE:-120} - $(date +%s)))
    [ $rem -lt $lim ] && lim=$rem
  fi
  # shellcheck disable=SC2086
  timeout $lim $bin bench train --backend cuda --model $m --accum $a --batch 8 --steps 4 --device-budget $budget \
    --policy ${POLICY:-planned} --machine ${MACHINE:-h200} $flags > /tmp/pred-logs/$name.log 2>&1
  grep -E "plan:|auto|tokens/s|GPU stalled|predicted|own steps|speculat|first step|error" /tmp/pred-logs/$name.log | cut -c1-300 | tee -a "$out/summary.txt"
  pred=$(awk '/^predicted  /{print $2; exit}' /tmp/pred-logs/$name.log)
  own=$(awk '/^own steps  /{print $3; exit}' /tmp/pred-logs/$name.log)
  if [ -n "$pred" ] && [ -n "$own" ]; then
    echo "$m $a $budget [$flags] predicted $pred s, own steps $own s, error $(awk -v p="$pred" -v o="$own" 'BEGIN{printf "%+.1f%%", 100*(p-o)/o}')" >> "$table"
  else
    echo "$m $a $budget [$flags] no figure (see the log)" >> "$table"
  fi
  tar -czf "$out/pred-logs.tar.gz" -C /tmp pred-logs
done
log "predicted against measured"
tee -a "$out/summary.txt" < "$table"
