#!/usr/bin/env bash
# One call on the lent H200, most telling first: for each of TRACE_MODELS (default
# gpt-2.7b gpt-4b) a measured trace of step 2 under 24 GiB with clipping off (every
# speculation stands) beside the simulator's trace of the same plan (train --trace /
# --trace-predicted); a full `spillway profile`; then exactness of EXACT (default
# gpt2-1.5b:1 gpt2-1.5b:4) at 24 GiB against resident with clipping in the first steps
# only (EXACT_FLAGS, default --grad-clip 50); with BENCH_MEASURED=1 last a bench of the
# first traced model planned on the measured machine. THREADS_AB=1 (default): the
# first traced model's bench with the default host threads, --threads 16,
# --speculate off and on, and SPILLWAY_CUDA_SCHEDULE=blocking (waits sleep).
# Results: $OUT/summary.txt, $OUT/traces.tar.gz, $OUT/h200-measured.json.
# Usage (device tool, carry .deps): scripts/device-traces.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/traces /tmp/spill
bin=build-device/spillway
scripts/device-build.sh spillway > /tmp/traces/build.log 2>&1 || { tail -30 /tmp/traces/build.log; exit 1; }
pack() { tar -czf "$out/traces.tar.gz" -C /tmp traces; }
for m in ${TRACE_MODELS:-gpt-2.7b gpt-4b}; do
  echo "== trace: $m accum 1, 24 GiB, --grad-clip 0" | tee -a "$out/summary.txt"
  timeout 200 $bin train --backend cuda --model $m --batch 8 --context 1024 --steps 3 --grad-clip 0 --eval-every 0 \
    --device-budget 24GiB --policy planned --machine ${MACHINE:-h200} --trace /tmp/traces/measured_$m.json \
    --trace-predicted /tmp/traces/predicted_$m.json > /tmp/traces/train_$m.log 2>&1
  grep -E "plan:|predicted step|step [0-9]+ |error" /tmp/traces/train_$m.log | head -8 | tee -a "$out/summary.txt"
  pack
done
# The issuing thread against the host optimizer's threads: the default pool leaves it
# a core (15 of 16), --threads 16 does not; and speculation on against off.
if [ "${THREADS_AB:-1}" = 1 ]; then
  m=${TRACE_MODELS:-gpt-2.7b gpt-4b}; m=${m%% *}
  for flags in "" "--threads 16" "--speculate off" "--speculate on" "SCHED=blocking" "SCHED=blocking --speculate off"; do
    sched=auto; case "$flags" in SCHED=*) sched=${flags#SCHED=}; sched=${sched%% *}; flags=${flags#SCHED=$sched} ;; esac
    echo "== bench $m accum 1, 24 GiB, --grad-clip 0 $flags (SPILLWAY_CUDA_SCHEDULE=$sched)" | tee -a "$out/summary.txt"
    # shellcheck disable=SC2086
    SPILLWAY_CUDA_SCHEDULE=$sched timeout 150 $bin bench train --backend cuda --model $m --batch 8 --steps 4 --grad-clip 0 --device-budget 24GiB \
      --policy planned --machine ${MACHINE:-h200} $flags 2>&1 | grep -E "tokens/s|predicted|own steps|^  [0-9]+ step" |
      tee -a "$out/summary.txt"
  done
fi
echo "== host AdamW in place against out of place (the speculative update)" | tee -a "$out/summary.txt"
for into in "" "--into"; do $bin bench adam --params 5e8 --simd avx512 --iters 5 $into 2>&1 | tail -1 | sed "s/^/${into:-in-place} /" | tee -a "$out/summary.txt"; done
echo "== profile --backend cuda" | tee -a "$out/summary.txt"
timeout 200 $bin profile --backend cuda --spill-dir /tmp/spill --out "$out/h200-measured.json" > /tmp/traces/profile.txt 2>&1
grep -E "synchronization|kept|sample step|gpt2-|written|error|host AdamW runs" /tmp/traces/profile.txt | tee -a "$out/summary.txt"
pack
MACHINE=${MACHINE:-h200} OUT=/tmp/traces/exact PART=exact EXACT="${EXACT:-gpt2-1.5b:1 gpt2-1.5b:4}" \
  EXACT_FLAGS="${EXACT_FLAGS:---grad-clip 50}" scripts/device-pipeline.sh > /tmp/traces/pipeline.log 2>&1
cat /tmp/traces/exact/summary.txt >> "$out/summary.txt"
pack
if [ "${BENCH_MEASURED:-0}" = 1 ]; then
  m=${TRACE_MODELS:-gpt-2.7b gpt-4b}; m=${m%% *}
  echo "== $m accum 1, 24 GiB, --grad-clip 0, --machine (the profile above)" | tee -a "$out/summary.txt"
  timeout 150 $bin bench train --backend cuda --model $m --batch 8 --steps 4 --grad-clip 0 --device-budget 24GiB \
    --policy planned --machine "$out/h200-measured.json" 2>&1 | grep -E "plan:|tokens/s|predicted|own steps|^  [0-9]+ step" |
    tee -a "$out/summary.txt"
fi
