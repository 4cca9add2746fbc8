#!/usr/bin/env bash
# One call on the lent H200 for issue 10's speculative updates: build; exactness of
# gpt2-1.5b at 24 GiB against resident (EXACT_FLAGS, default --grad-clip 50: the first
# steps clip, the later ones do not, so both the redo and the commit paths run);
# then bench train at 24 GiB for each RUNS entry model:accum:flags (flags with '+'
# for spaces; MACHINE, default h200, is the planner's machine), and a CUDA profile of this machine. Logs in $OUT/logs.tar.gz, table in
# $OUT/summary.txt. Usage (device tool, carry .deps): scripts/device-speculation.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/logs /tmp/spill
log() { echo "== $*" | tee -a "$out/summary.txt"; }
bin=build-device/spillway
MACHINE=${MACHINE:-h200} OUT=/tmp/logs/exact PART=exact EXACT="${EXACT:-gpt2-1.5b:1 gpt2-1.5b:4}" EXACT_FLAGS="${EXACT_FLAGS:---grad-clip 50}" \
  scripts/device-pipeline.sh >/dev/null 2>&1
cat /tmp/logs/exact/summary.txt >> "$out/summary.txt"
for r in ${RUNS:-gpt-2.7b:1:--grad-clip+0 gpt2-1.5b:4:--grad-clip+0 gpt-4b:1:--grad-clip+0 gpt-2.7b:1:--grad-clip+0+--speculate+off gpt2-1.5b:1:--machine+measured}; do
  m=${r%%:*}; rest=${r#*:}; a=${rest%%:*}; flags=${rest#*:}; flags=${flags//+/ }
  name=b24_${m}_${a}_$(echo "$flags" | tr -c 'a-z0-9\n' '_')
  case "$flags" in *--machine*) mf="" ;; *) mf="--machine ${MACHINE:-h200}" ;; esac
  log "24 GiB: $m accum $a $flags"
  timeout 240 $bin bench train --backend cuda --model $m --accum $a --batch 8 --steps 4 --device-budget 24GiB \
    --policy planned $mf $flags > /tmp/logs/$name.log 2>&1
  grep -E "plan:|tokens/s|GPU stalled|predicted|speculation|own steps|^  [0-9]+ step|^step |machine:" /tmp/logs/$name.log | tee -a "$out/summary.txt"
done
if [ "${PROFILE:-1}" = 1 ]; then
  log "profile --backend cuda"
  timeout 200 $bin profile --backend cuda --spill-dir /tmp/spill --out "$out/h200-measured.json" > /tmp/logs/profile.txt 2>&1
  tail -40 /tmp/logs/profile.txt >> "$out/summary.txt"
fi
for f in ~/.cache/spillway/machine-*.json; do [ -f "$f" ] && cp "$f" "$out/brief-$(basename "$f")"; done
tar -czf "$out/logs.tar.gz" -C /tmp logs
