#!/usr/bin/env bash
# One part of a call on the lent H200 for issue 13: `bench train --policy auto` at a
# 24 GiB budget. Auto ranks its candidates by the simulator, times the best two for a
# step each (--auto-confirm 2) and keeps the faster, printing both figures; the plan
# planned picks is printed beside it. Usage (device tool, carry .deps; builds first):
#   CONFIGS="gpt2-1.5b:1 gpt-2.7b:1" scripts/device-auto.sh      (results in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
bin=build-device/spillway
for c in ${CONFIGS:-gpt2-1.5b:1 gpt2-1.5b:4 gpt-2.7b:1}; do
  m=${c%%:*}; a=${c##*:}
  log "auto, $m accum $a, 24 GiB"
  timeout 300 $bin bench train --backend cuda --model $m --batch 8 --accum $a --steps 4 --device-budget 24GiB \
    --policy auto --json "$out/auto_${m}_$a.json" > "$out/auto_${m}_$a.log" 2>&1 || tail -5 "$out/auto_${m}_$a.log"
  grep -E "auto:|confirm|candidate|plan:|tokens/s|predicted|GPU stalled" "$out/auto_${m}_$a.log" | cut -c1-400 | tee -a "$out/summary.txt"
done
