#!/usr/bin/env bash
# One call on the lent GPU for issue 14's attention kernels: builds, runs the CUDA
# attention tests (against the CPU reference, and the Hopper wgmma kernels against the
# mma.sync ones element by element), then times the attention rows of `spillway bench
# ops` with each kernel (KERNELS, default "auto mma": SPILLWAY_CUDA_ATTENTION) beside
# PyTorch's SDPA (bench/peers/torch_attention.py) at the gpt2-124m, gpt2-1.5b and
# gpt-2.7b shapes.
# VARIANTS: builds to compare in the same call, each a list of nvcc defines with ','
# for spaces ("-" for none); default "-". For example
#   VARIANTS="- -DMY_SWITCH=1" KERNELS=auto scripts/device-attention.sh
# builds the default and a variant that a #ifdef in the kernels selects, side by side
# (build-device, build-device-2, ...): session 38 compared one warpgroup a query block
# with two that way (bench/RESULTS.md) and kept two. TRAIN: models to train with each variant, model:batch:runs
# (`bench train --backend cuda --steps 5`), then PEERS (torch_gpt.py configurations).
# TESTS: the test_backend filter for the first variant (default 'CudaOps.*Attention*'),
# TESTS_LATER for the others (default TESTS; '-' runs none). OPS_ROWS: the rows of
# bench ops to print (an extended regular expression, default '^attention'). EXACT=1:
# the budgeted-against-resident exactness check (scripts/device-exactness.sh) with the
# first variant. SDPA=0 skips PyTorch's SDPA timings. NCU=regex: Nsight Compute's view of
# the matching kernels at the first shape (below).
# Stops after the first variant's tests if they fail; a later variant that fails its
# tests is left out of the timings (its number stays in the log lines). Usage (device tool, carry .deps):
#   scripts/device-attention.sh        (summary in $OUT/summary.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
logs=${LOGS:-/tmp/attention-logs}; mkdir -p "$logs"
log() { echo "$*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
machine=machines/h100.json
[[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]] && machine=machines/h200.json
# SHAPES: the bench ops shapes, "B C NH" each, ';' between them (default the three
# above).
IFS=';' read -r -a SHAPES <<< "${SHAPES:-16 768 12;8 1600 25;8 2560 32}"
i=0; dirs=(); nums=()
for v in ${VARIANTS:--}; do
  i=$((i + 1)); dir=build-device; [ $i -gt 1 ] && dir=build-device-$i
  defs=${v//,/ }; [ "$defs" = "-" ] && defs=""
  BUILD_DIR=$dir CUDA_DEFINES="$defs" scripts/device-build.sh spillway test_backend > "$logs/build-$i.log" 2>&1 ||
    { tail -40 "$logs/build-$i.log"; exit 1; }
  log "variant $i [$defs]: build $(( $(date +%s) - t0 )) s"
  filter=${TESTS:-CudaOps.*Attention*}
  [ $i -gt 1 ] && filter=${TESTS_LATER:-$filter}
  if [ "$filter" != "-" ]; then
    timeout 300 $dir/test_backend --gtest_filter="$filter" > "$logs/attention-tests-$i.log" 2>&1
    rc=$?
    log "variant $i $filter: rc $rc $(grep -E '^\[  (PASSED|FAILED)' "$logs/attention-tests-$i.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED|Failure' -A3 "$logs/attention-tests-$i.log" | head -30 | tee -a "$out/summary.txt"
    # A variant that fails its tests is left out of the timings; the first one stops the call.
    [ "$rc" = 0 ] || { [ $i -eq 1 ] && exit 0; log "variant $i left out"; continue; }
  fi
  dirs+=("$dir"); nums+=("$i")
done
if [ "${EXACT:-0}" = 1 ]; then
  BIN=${dirs[0]}/spillway MACHINE=$machine OUT=$logs scripts/device-exactness.sh budgets "variant 1" 200MiB |
    tee -a "$out/summary.txt"
fi
for shape in "${SHAPES[@]}"; do
  set -- $shape
  for k in ${KERNELS:-auto mma}; do
    for i in "${!dirs[@]}"; do
      r=$(SPILLWAY_CUDA_ATTENTION=$k timeout 120 ${dirs[$i]}/spillway bench ops --backend cuda --B "$1" --T 1024 \
        --C "$2" --NH "$3" --V 50304 2>&1 | grep -E "${OPS_ROWS:-^attention}" | tr -s ' ' | tr '\n' ';')
      log "variant ${nums[$i]} B=$1 C=$2 NH=$3 SPILLWAY_CUDA_ATTENTION=$k: $r"
    done
  done
done
# NCU: kernel-name regular expressions, ',' between them; Nsight Compute's sections for
# the first NCU_COUNT (default 1) launches of each, for the variants NCU_VARIANTS
# (numbers, default "1"), at the first shape (text
# in $OUT/ncu-VARIANT-K.txt; the summary gets the duration, the tensor, MUFU and
# shared-memory pipes, occupancy and the stalls).
if [ -n "${NCU:-}" ]; then
  set -- ${SHAPES[0]}
  IFS=',' read -r -a ncu_names <<< "$NCU"
  for i in "${!dirs[@]}"; do
    [[ " ${NCU_VARIANTS:-1} " == *" ${nums[$i]} "* ]] || continue
    for k in "${!ncu_names[@]}"; do
      f="$out/ncu-${nums[$i]}-$((k + 1)).txt"
      timeout 240 ncu --clock-control none --kernel-name "regex:${ncu_names[$k]}" --launch-count "${NCU_COUNT:-1}" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section LaunchStats \
        --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct \
        ${dirs[$i]}/spillway bench ops --backend cuda --B "$1" --T 1024 --C "$2" --NH "$3" --V 50304 > "$f" 2>&1
      log "variant ${nums[$i]} ncu ${ncu_names[$k]} B=$1 C=$2 NH=$3: rc $?"
      grep -E "^  [A-Za-z_]+.*\(|Duration|Throughput|gmma|pipe_xu|mem_shared|issue_stalled|Registers Per|Occupancy|Block Limit" "$f" |
        tr -s ' ' | head -40 | tee -a "$out/summary.txt"
    done
  done
fi
[ "${SDPA:-1}" = 0 ] || timeout 180 python3 bench/peers/torch_attention.py 16:1024:12:64 8:1024:25:64 8:1024:32:80 2>&1 |
  tee -a "$out/summary.txt"
for mb in ${TRAIN:-}; do
  IFS=: read -r m b runs <<< "$mb"
  for r in $(seq ${runs:-1}); do
    for i in "${!dirs[@]}"; do
      timeout 200 ${dirs[$i]}/spillway bench train --backend cuda --model $m --batch $b --steps 5 \
        --machine $machine > "$logs/train_${m}_${nums[$i]}_$r.log" 2>&1
      log "variant ${nums[$i]} $m B$b (run $r): $(grep -E '^own steps' "$logs/train_${m}_${nums[$i]}_$r.log" | cut -c1-80)"
    done
  done
done
for p in ${PEERS:-}; do
  log "peer $p: $(NMEAS=4 timeout 240 python3 bench/peers/torch_gpt.py $p 2>&1 | tail -1)"
done
log "done $(( $(date +%s) - t0 )) s"
