#!/usr/bin/env bash
# One device call for issue 14: the products' cuBLASLt epilogues (the GELU's, on by
# default, SPILLWAY_CUDA_GELU_EPILOGUE; the residual add's, SPILLWAY_CUDA_RESIDUAL_EPILOGUE;
# the bias gradient's, SPILLWAY_CUDA_BIAS_EPILOGUE) checked and timed beside torch.compile.
#   1. the CUDA op tests (all of CudaOps, the epilogues' among them);
#   2. bench ops at T 1024 for each of OPS_CONFIGS (default: default; the
#      fused rows beside their parts);
#   3. exactness (scripts/device-exactness.sh) for each of EXACT_CONFIGS (default
#      CONFIGS): gpt2-124m resident
#      twice and under the planned budget XBUDGETS with speculation, losses and weights;
#   4. bench train for each of MODELS (model:micro-batch[:repeats]), resident, for each
#      of CONFIGS in turn, repeats (or REPEATS, default 1) times, then the PyTorch peers PEERS
#      (bench/peers/torch_gpt.py);
#   5. one gpt2-124m step against PyTorch with every epilogue on (loss, every gradient).
# CONFIGS: names among default (the environment untouched: every epilogue, since
# session 38), none (no epilogue), gelu, bias (GELU and bias gradient), all (GELU,
# residual and bias gradient), inorder and overlap (the defaults with the AdamW batches
# on the compute stream, SPILLWAY_CUDA_OPTIMIZER_STREAM=0, or on a stream of their own
# that the next step's forward overlaps, =1).
# Each part adds to $OUT/summary.txt as it finishes (logs in $LOGS, default
# /tmp/fusion-logs); a short table ends it.
# Usage (device tool, carry .deps):
#   MODELS="gpt2-350m:16" PEERS="350M:compile:16" PARTS="train" scripts/device-fusion.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
# summary.txt and the bench ops tables in $OUT (the device tool brings back only a
# few files); every log in $LOGS.
logs=${LOGS:-/tmp/fusion-logs}; mkdir -p "$logs"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
log "gpu: $gpu"
# MORE_TESTS: other test binaries' GPU tests for part "tests", each binary:filter, for
# example "test_train:CudaOptimizerStream.* test_dist:CudaCollectiveStream.*".
more_bins=$(for t in ${MORE_TESTS:-}; do echo "${t%%:*}"; done | sort -u | tr '\n' ' ')
scripts/device-build.sh spillway test_backend $more_bins > "$logs/build.log" 2>&1 || { tail -40 "$logs/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
export BIN=build-device/spillway MACHINE=machines/h100.json OUT=$logs
[[ "$gpu" == *H200* ]] && MACHINE=machines/h200.json
parts=" ${PARTS:-tests ops exact train gradcheck} "
configs=${CONFIGS:-default}
# The environment of a configuration, as `env` arguments.
config_env() {
  case "$1" in
    default) echo ;;
    none) echo SPILLWAY_CUDA_GELU_EPILOGUE=0 SPILLWAY_CUDA_RESIDUAL_EPILOGUE=0 SPILLWAY_CUDA_BIAS_EPILOGUE=0 ;;
    gelu) echo SPILLWAY_CUDA_GELU_EPILOGUE=1 SPILLWAY_CUDA_RESIDUAL_EPILOGUE=0 SPILLWAY_CUDA_BIAS_EPILOGUE=0 ;;
    all) echo SPILLWAY_CUDA_GELU_EPILOGUE=1 SPILLWAY_CUDA_RESIDUAL_EPILOGUE=1 SPILLWAY_CUDA_BIAS_EPILOGUE=1 ;;
    bias) echo SPILLWAY_CUDA_GELU_EPILOGUE=1 SPILLWAY_CUDA_RESIDUAL_EPILOGUE=0 SPILLWAY_CUDA_BIAS_EPILOGUE=1 ;;
    inorder) echo SPILLWAY_CUDA_OPTIMIZER_STREAM=0 ;;
    overlap) echo SPILLWAY_CUDA_OPTIMIZER_STREAM=1 ;;
    *) echo "unknown configuration '$1' (expected default, none, gelu, bias, all, inorder or overlap)" >&2; exit 2 ;;
  esac
}

if [[ "$parts" == *" tests "* ]]; then
  timeout 240 build-device/test_backend --gtest_filter="${TESTS:-CudaOps.*}" > "$logs/cudaops.log" 2>&1
  log "CudaOps: rc $? $(grep -E '^\[  (PASSED|FAILED)' "$logs/cudaops.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure' -A4 "$logs/cudaops.log" | head -30 | tee -a "$out/summary.txt"
  for t in ${MORE_TESTS:-}; do
    timeout 240 build-device/${t%%:*} --gtest_filter="${t#*:}" > "$logs/more.log" 2>&1
    log "$t: rc $? $(grep -E '^\[  (PASSED|FAILED|  SKIPPED)' "$logs/more.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED|Failure' -A4 "$logs/more.log" | head -30 | tee -a "$out/summary.txt"
  done
fi
if [[ "$parts" == *" ops "* ]]; then
  for c in ${OPS_CONFIGS:-default}; do
    env $(config_env $c) timeout 120 $BIN bench ops --backend cuda --T 1024 > "$out/ops_$c.txt" 2>&1
    grep -E "matmul|fc|gelu|proj|residual|attention|layernorm|adamw|step estimate|rror" "$out/ops_$c.txt" |
      sed "s/^/$c: /" | tee -a "$out/summary.txt"
  done
fi
if [[ "$parts" == *" exact "* ]]; then
  for c in ${EXACT_CONFIGS:-$configs}; do
    env $(config_env $c) scripts/device-exactness.sh budgets "epilogues $c" ${XBUDGETS:-200MiB} | tee -a "$out/summary.txt"
  done
fi
table=""
if [[ "$parts" == *" train "* ]]; then
  for mb in ${MODELS:-gpt2-124m:16}; do
    IFS=: read -r m b reps <<< "$mb"
    for i in $(seq ${reps:-${REPEATS:-1}}); do
      for c in $configs; do
        run_log="$logs/bench_${m}_${c}_$i.log"
        env $(config_env $c) timeout 200 $BIN bench train --backend cuda --model $m --batch $b --steps ${STEPS:-5} \
          --machine $MACHINE > "$run_log" 2>&1
        line=$(grep -E '^own steps' "$run_log" | head -1)
        log "$m B$b epilogues $c (run $i): $(echo "$line" | cut -c1-160)"
        grep -E '^MFU|^host issue' "$run_log" | head -2 | cut -c1-200 | tee -a "$out/summary.txt"
        table+="$m B$b spillway/$c (run $i): $(echo "$line" | grep -oE '[0-9.]+k? tokens/s' | head -1)"$'\n'
      done
    done
  done
  for p in ${PEERS-124M:compile:16}; do
    r=$(NMEAS=4 timeout 240 python3 bench/peers/torch_gpt.py $p 2>&1 | tail -1)
    log "peer $p: $r"
    table+="peer $p: $(echo "$r" | python3 -c 'import json,sys
try:
    r = json.loads(sys.stdin.read()); print("%.1fk tokens/s, MFU %.3f" % (r["tok_s"] / 1e3, r["mfu_989"]))
except Exception as e:
    print("no result", e)')"$'\n'
  done
fi
if [[ "$parts" == *" gradcheck "* ]]; then
  env $(config_env all) scripts/device-exactness.sh gradcheck "epilogues all" | tee -a "$out/summary.txt"
fi
log "total $(( $(date +%s) - t0 )) s"
printf '%s' "$table" | tee -a "$out/summary.txt"
