#!/usr/bin/env bash
# One device call for issues 10 and 13 (session 33): build; on an H200, profile it and
# plan with that file (else machines/h100.json); a CUDA exactness check (gpt2-124m,
# resident against planned budgets XBUDGETS with speculation, clipping at XCLIP:
# losses and saved weights); the PyTorch peers PEERS (torch_gpt.py configs; empty
# for none); then scripts/device-predictions.sh over RUNS (planned) and AUTO_RUNS
# (policy auto), ending by PRED_END / AUTO_END seconds after the start. PROFILE=0
# skips the H200's profile (then machines/h200.json, or MACHINE_FILE); NMEAS: the
# peers' measured steps (default 3).
# Usage (device tool, carry .deps): RUNS="gpt-2.7b:1:24GiB:--grad-clip+0" scripts/device-call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
t0=$(date +%s)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "gpu: $gpu"
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
machine=${MACHINE_FILE:-machines/h100.json}
[[ "$gpu" == *H200* ]] && [ -z "${MACHINE_FILE:-}" ] && machine=machines/h200.json
if [[ "$gpu" == *H200* ]] && [ "${PROFILE:-1}" = 1 ]; then
  mkdir -p /tmp/spill
  $bin profile --backend cuda --spill-dir /tmp/spill --out $out/h200-profiled.json > $out/profile.log 2>&1 && machine=$out/h200-profiled.json
  tail -25 $out/profile.log; echo "profiled $(( $(date +%s) - t0 )) s"
fi
# exactness: default plan (late zeros), speculation with drops, clipping in the first steps only
if [ -n "${XBUDGETS-300MiB 200MiB}" ]; then
  BIN=$bin MACHINE=$machine OUT=$out XCLIP=${XCLIP:-5} scripts/device-exactness.sh budgets "cuda 124m" ${XBUDGETS:-300MiB 200MiB}
  grep -hE "speculat|plan:" $out/x_cuda_124m_*.log | cut -c1-250
fi
echo "peer start $(( $(date +%s) - t0 )) s"
for p in ${PEERS-2.7B:full:8}; do NMEAS=${NMEAS:-3} python3 bench/peers/torch_gpt.py $p 2>&1 | tail -1; done
echo "preds start $(( $(date +%s) - t0 )) s"
if [ -n "${RUNS:-}" ]; then
  SKIP_BUILD=1 DEADLINE=$(( t0 + ${PRED_END:-470} )) RUN_GRACE=60 MACHINE=$machine RUNS="$RUNS" scripts/device-predictions.sh > $out/pred.txt 2>&1
  grep -E "regime|step with|steps with|own steps|predicted|speculat|zero|tokens/s" $out/pred.txt | cut -c1-200 | head -90
fi
if [ -n "${AUTO_RUNS:-}" ]; then
  SKIP_BUILD=1 DEADLINE=$(( t0 + ${AUTO_END:-540} )) RUN_GRACE=40 POLICY=auto MACHINE=$machine RUNS="$AUTO_RUNS" scripts/device-predictions.sh > $out/auto.txt 2>&1
  grep -E "own steps|predicted|^== " $out/auto.txt | cut -c1-200
  grep -o 'timed one step each.*' $out/auto.txt
fi
echo "total $(( $(date +%s) - t0 )) s"
