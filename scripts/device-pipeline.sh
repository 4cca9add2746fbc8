#!/usr/bin/env bash
# One call on the lent H200 for issue 10 (the step as a pipelined loop): build, CUDA
# exactness of budgeted runs against resident ones (gpt2-1.5b at 24 GiB included),
# and the 24 GiB throughput table beside the no-limit PyTorch peer, in one call.
# Usage (device tool, carry .deps): scripts/device-pipeline.sh   (results in $OUT)
# PART=exact runs only the exactness checks; PART=speed only the timings. EXACT and
# MODELS (model:accum ...), PEERS (torch_gpt.py configs) and
# MACHINE (the planner's machine, default the h200 preset: without it a fresh device
# machine would profile itself on first use and plan with that), BENCH_FLAGS (added to every bench), EXACT_FLAGS (added to the exactness runs, e.g.
# --grad-clip 50 so that only the first steps clip) choose what runs; RULE=0 skips the rule's plan.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
part=${PART:-all}
if [ "$part" != speed ]; then
  # Tiny: resident against planned at 48 MiB with the optimizer split and all on host.
  $bin train --backend cuda --model tiny --steps 20 --batch 8 --eval-every 10 --machine ${MACHINE:-h200} --metrics "$out/tiny_resident.jsonl" --quiet > "$out/exact.log" 2>&1
  for d in auto 0; do
    $bin train --backend cuda --model tiny --steps 20 --batch 8 --eval-every 10 --device-budget 48MiB --policy planned \
      --machine ${MACHINE:-h200} --device-optimizer $d --metrics "$out/tiny_planned_$d.jsonl" >> "$out/exact.log" 2>&1 || tail -3 "$out/exact.log"
  done
  grep "plan:" "$out/exact.log" | tee -a "$out/summary.txt"
  scripts/same_losses.py "cuda exactness, tiny, eval every 10" "$out/tiny_resident.jsonl" "$out/tiny_planned_auto.jsonl" "$out/tiny_planned_0.jsonl" | tee -a "$out/summary.txt"
  # EXACT: model:accum pairs, resident against 24 GiB planned.
  for ma in ${EXACT:-gpt2-1.5b:1 gpt2-1.5b:4}; do
    m=${ma%:*}; a=${ma#*:}
    log "$m accum $a: resident against 24 GiB planned, 5 steps (lr 3e-3: clipping active in some)"
    timeout 200 $bin train --backend cuda --model $m --batch 8 --context 1024 --accum $a --steps 5 --lr 3e-3 --warmup 0 \
      --eval-every 0 ${EXACT_FLAGS:-} --machine ${MACHINE:-h200} --metrics "$out/x_res_${m}_$a.jsonl" > "$out/x_res_${m}_$a.log" 2>&1 || tail -3 "$out/x_res_${m}_$a.log"
    timeout 200 $bin train --backend cuda --model $m --batch 8 --context 1024 --accum $a --steps 5 --lr 3e-3 --warmup 0 \
      --eval-every 0 ${EXACT_FLAGS:-} --machine ${MACHINE:-h200} --device-budget 24GiB --policy planned --metrics "$out/x_24_${m}_$a.jsonl" > "$out/x_24_${m}_$a.log" 2>&1 || tail -3 "$out/x_24_${m}_$a.log"
    grep -E "plan:|speculat" "$out/x_24_${m}_$a.log" | tee -a "$out/summary.txt"
    scripts/same_losses.py "cuda exactness, $m accum $a, 24 GiB" "$out/x_res_${m}_$a.jsonl" "$out/x_24_${m}_$a.jsonl" | tee -a "$out/summary.txt"
    python3 -c "import json,sys; print('grad norms:', [round(json.loads(l)['grad_norm'],3) for l in open(sys.argv[1])])" "$out/x_24_${m}_$a.jsonl" | tee -a "$out/summary.txt"
  done
fi
if [ "$part" != exact ]; then
  for ma in ${MODELS:-gpt2-1.5b:1 gpt2-1.5b:4 gpt-2.7b:1 gpt-2.7b:4 gpt-4b:1}; do
    m=${ma%:*}; a=${ma#*:}
    log "24 GiB budget: $m --accum $a (planned)"
    timeout 240 $bin bench train --backend cuda --model $m --accum $a --batch 8 --steps 4 --device-budget 24GiB \
      --policy planned --machine ${MACHINE:-h200} ${BENCH_FLAGS:-} --json "$out/b24_${m}_$a.json" > "$out/b24_${m}_$a.log" 2>&1
    grep -E "plan:|tokens/s|GPU stalled|executor waits|first step|MFU|predicted|speculat|own steps|^  [0-9]+ step" "$out/b24_${m}_$a.log" | tee -a "$out/summary.txt"
  done
  # The optimizer share of the half-budget rule, beside the searched one above (RULE=0 skips).
  if [ "${RULE:-1}" != 0 ]; then
    log "24 GiB budget: gpt2-1.5b --accum 1 (planned, --device-optimizer rule)"
    timeout 240 $bin bench train --backend cuda --model gpt2-1.5b --accum 1 --batch 8 --steps 4 --device-budget 24GiB \
      --policy planned --machine ${MACHINE:-h200} --device-optimizer rule > "$out/b24_rule.log" 2>&1
    grep -E "plan:|tokens/s|GPU stalled|executor waits|predicted" "$out/b24_rule.log" | tee -a "$out/summary.txt"
  fi
  log "PyTorch peer, no memory limit, same machine"
  NMEAS=2 timeout 200 python3 bench/peers/torch_gpt.py ${PEERS:-1.5B:full:8 2.7B:full:8 4B:full:8} 2>&1 | tail -4 | tee -a "$out/summary.txt"
fi
log "total $(( $(date +%s) - t0 )) s"
