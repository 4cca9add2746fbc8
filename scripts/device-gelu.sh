#!/usr/bin/env bash
# One device call for issue 14 (session 36, bench/RESULTS.md): the GELU in the
# products' cuBLASLt epilogue against the product and GELU kernel
# (SPILLWAY_CUDA_GELU_EPILOGUE=1|0), and the attention forward beside SDPA.
#   1. the CUDA op tests (all of CudaOps: the epilogue and attention ones among them);
#   2. bench ops at T 1024 with the switch at 0 and 1 (the fused rows beside the parts,
#      the attention rows) beside SDPA (bench/peers/torch_attention.py);
#   3. exactness with the epilogue on: gpt2-124m resident against a planned budget with
#      speculation, losses and saved weights; the resident run twice (same bits);
#   4. bench train gpt2-124m B16 (MODELS), resident, switch 0 and 1, beside torch.compile;
#   5. one gpt2-124m step against PyTorch with the epilogue on (loss, every gradient);
#   6. Nsight Compute's warp-state and occupancy sections for one attention forward.
# Each part writes into $OUT as it finishes. Usage (device tool, carry .deps):
#   scripts/device-gelu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
log "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
scripts/device-build.sh spillway test_backend > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
bin=build-device/spillway
machine=machines/h100.json
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && machine=machines/h200.json

# 1. CUDA op tests.
timeout 240 build-device/test_backend --gtest_filter="${TESTS:-CudaOps.*}" > "$out/cudaops.log" 2>&1
log "CudaOps: rc $? $(grep -E '^\[  (PASSED|FAILED)' "$out/cudaops.log" | tr '\n' ' ')"
grep -E '^\[  FAILED|Failure' -A4 "$out/cudaops.log" | head -30 | tee -a "$out/summary.txt"

# 2. bench ops with the switch at 0 and 1; SDPA at the 124M shape.
for s in 0 1; do
  SPILLWAY_CUDA_GELU_EPILOGUE=$s timeout 90 $bin bench ops --backend cuda --T 1024 > "$out/ops_$s.txt" 2>&1
done
grep -E "fc|gelu|adamw|squared|step estimate|layernorm|residual|attention" "$out/ops_1.txt" | tee -a "$out/summary.txt"
grep -E "step estimate" "$out/ops_0.txt" | sed 's/^/switch 0: /' | tee -a "$out/summary.txt"
timeout 90 python3 bench/peers/torch_attention.py 16:1024:12:64 2>&1 | tail -3 | tee -a "$out/summary.txt"

# 3. Exactness with the epilogue on.
export SPILLWAY_CUDA_GELU_EPILOGUE=1
x="train --backend cuda --model gpt2-124m --context 256 --batch 4 --steps 6 --seed 5 --lr 3e-3 --warmup 0 --grad-clip 5 --machine $machine"
for r in res res2; do timeout 90 $bin $x --metrics $out/x_$r.jsonl --save /tmp/x_$r > $out/x_$r.log 2>&1 || tail -5 $out/x_$r.log; done
scripts/same_losses.py "epilogue on, resident twice" $out/x_res.jsonl $out/x_res2.jsonl | tee -a "$out/summary.txt"
cmp -s /tmp/x_res/model.safetensors /tmp/x_res2/model.safetensors && log "resident twice: weights IDENTICAL"
for bud in ${XBUDGETS:-200MiB}; do
  timeout 120 $bin $x --policy planned --device-budget $bud --speculate on --metrics $out/x_$bud.jsonl --save /tmp/x_$bud > $out/x_$bud.log 2>&1 ||
    tail -5 $out/x_$bud.log
  scripts/same_losses.py "epilogue on, 124m $bud speculate" $out/x_res.jsonl $out/x_$bud.jsonl | tee -a "$out/summary.txt"
  cmp -s /tmp/x_res/model.safetensors /tmp/x_$bud/model.safetensors && log "$bud weights IDENTICAL"
done
SPILLWAY_CUDA_GELU_EPILOGUE=0 timeout 90 $bin $x --metrics $out/x_off.jsonl > $out/x_off.log 2>&1
python3 -c "
import json,sys
a=[json.loads(l)['loss'] for l in open(sys.argv[1])]; b=[json.loads(l)['loss'] for l in open(sys.argv[2])]
print('losses epilogue off:', a); print('losses epilogue on: ', b)" $out/x_off.jsonl $out/x_res.jsonl | tee -a "$out/summary.txt"

# 4. Resident training, the switch at 0 and 1, beside torch.compile.
for mb in ${MODELS:-gpt2-124m:16}; do
  m=${mb%%:*}; b=${mb#*:}
  for s in 0 1; do
    SPILLWAY_CUDA_GELU_EPILOGUE=$s timeout 150 $bin bench train --backend cuda --model $m --batch $b --steps 5 \
      --machine $machine > "$out/bench_${m}_$s.log" 2>&1
    log "$m B$b epilogue $s: $(grep -E 'own steps' "$out/bench_${m}_$s.log" | head -1 | cut -c1-160)"
    grep -E 'MFU|host issue' "$out/bench_${m}_$s.log" | head -2 | cut -c1-200 | tee -a "$out/summary.txt"
  done
done
unset SPILLWAY_CUDA_GELU_EPILOGUE
for p in ${PEERS-124M:compile:16}; do
  log "peer $p: $(NMEAS=4 timeout 200 python3 bench/peers/torch_gpt.py $p 2>&1 | tail -1)"
done

# 5. One step against PyTorch with the epilogue on.
gc=/tmp/gradcheck
timeout 120 python3 bench/peers/torch_gradient_check.py prepare $gc --T 1024 > "$out/gradcheck.log" 2>&1
timeout 90 $bin train --backend cuda --data $gc/gc_train.bin --load $gc/init.safetensors --steps 1 --batch 4 --context 1024 \
  --eval-every 0 --quiet --metrics $gc/m.jsonl --save-grads $gc/grads.safetensors >> "$out/gradcheck.log" 2>&1
timeout 120 python3 bench/peers/torch_gradient_check.py compare $gc --B 4 --T 1024 >> "$out/gradcheck.log" 2>&1
log "gradcheck (epilogue on): $(tail -1 "$out/gradcheck.log")"

# 6. Where the attention forward's warps wait (Nsight Compute, one launch), if ncu is there.
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu_bin" ]; then
  timeout 120 "$ncu_bin" --clock-control none -k regex:attention_forward_wgmma -c 1 --section WarpStateStats \
    --section Occupancy --section SpeedOfLight $bin bench ops --backend cuda --T 1024 --reps 1 --rounds 1 \
    > "$out/ncu_attention.txt" 2>&1
  grep -E "Duration|Stall|Warp Cycles|Achieved Occupancy|Registers|Compute \(SM\)|Memory Throughput|Theoretical Occ" \
    "$out/ncu_attention.txt" | head -30 | tee -a "$out/summary.txt"
fi
log "total $(( $(date +%s) - t0 )) s"
