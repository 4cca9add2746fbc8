#!/usr/bin/env bash
# The CUDA exactness checks the device scripts share (run on the device, after a build):
#   budgets LABEL [BUDGET...]  gpt2-124m (context 256, 6 steps, lr 3e-3, clipping at
#       XCLIP, default 5) resident twice, then under each planned budget with
#       speculation (default 300MiB 200MiB): the losses (scripts/same_losses.py) and
#       the saved model.safetensors compared with the first resident run's, byte for byte.
#   gradcheck LABEL             one gpt2-124m step (B 4, T 1024) from the same weights
#       as PyTorch: the loss and every gradient (bench/peers/torch_gradient_check.py).
# Each prints one line per check, prefixed by LABEL, and exits non-zero when one fails.
# Environment: BIN (default build-device/spillway), MACHINE (a machine file, default
# machines/h100.json), OUT (logs; default /tmp/out); the CUDA switches in force apply.
# Usage: scripts/device-exactness.sh budgets "residual epilogue on" 200MiB
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-build-device/spillway}
machine=${MACHINE:-machines/h100.json}
out=${OUT:-/tmp/out}; mkdir -p "$out"
what=${1:?budgets or gradcheck}; label=${2:?a label for the output lines}; shift 2
tag=$(echo "$label" | tr -c 'A-Za-z0-9\n' '_')
fail=0
case "$what" in
  budgets)
    x="train --backend cuda --model gpt2-124m --context 256 --batch 4 --steps 6 --seed 5 --lr 3e-3 --warmup 0
       --grad-clip ${XCLIP:-5} --eval-every 0 --machine $machine"
    w=/tmp/exact_$tag; rm -rf "$w"; mkdir -p "$w"
    for r in res res2; do
      timeout 120 $bin $x --metrics $w/$r.jsonl --save $w/$r > $out/x_${tag}_$r.log 2>&1 ||
        { echo "$label: resident run failed"; tail -5 $out/x_${tag}_$r.log; exit 1; }
    done
    scripts/same_losses.py "$label, resident twice" $w/res.jsonl $w/res2.jsonl || fail=1
    if cmp -s $w/res/model.safetensors $w/res2/model.safetensors; then echo "$label, resident twice: weights IDENTICAL"
    else echo "$label, resident twice: weights DIFFER"; fail=1; fi
    for bud in "${@:-300MiB 200MiB}"; do
      for b in $bud; do
        timeout 150 $bin $x --policy planned --device-budget $b --speculate on --metrics $w/$b.jsonl --save $w/$b \
          > $out/x_${tag}_$b.log 2>&1 || { echo "$label, $b: run failed"; tail -5 $out/x_${tag}_$b.log; fail=1; continue; }
        scripts/same_losses.py "$label, $b planned speculate" $w/res.jsonl $w/$b.jsonl || fail=1
        if cmp -s $w/res/model.safetensors $w/$b/model.safetensors; then echo "$label, $b: weights IDENTICAL"
        else echo "$label, $b: weights DIFFER"; fail=1; fi
      done
    done
    python3 -c "import json,sys; print(sys.argv[2]+', losses:', [round(json.loads(l)['loss'],5) for l in open(sys.argv[1])])" \
      $w/res.jsonl "$label"
    ;;
  gradcheck)
    gc=/tmp/gradcheck
    [ -f $gc/init.safetensors ] ||
      timeout 150 python3 bench/peers/torch_gradient_check.py prepare $gc --T 1024 > "$out/gradcheck_prepare.log" 2>&1 ||
      { echo "$label: gradcheck prepare failed"; tail -5 "$out/gradcheck_prepare.log"; exit 1; }
    rm -f $gc/grads.safetensors
    timeout 120 $bin train --backend cuda --data $gc/gc_train.bin --load $gc/init.safetensors --steps 1 --batch 4 \
      --context 1024 --eval-every 0 --quiet --metrics $gc/m.jsonl --save-grads $gc/grads.safetensors \
      > "$out/gradcheck_$tag.log" 2>&1 || { echo "$label: gradcheck run failed"; tail -5 "$out/gradcheck_$tag.log"; exit 1; }
    timeout 120 python3 bench/peers/torch_gradient_check.py compare $gc --B 4 --T 1024 >> "$out/gradcheck_$tag.log" 2>&1 || fail=1
    echo "$label, gradcheck: $(tail -1 "$out/gradcheck_$tag.log")"
    ;;
  *) echo "device-exactness.sh: unknown check '$what' (expected budgets or gradcheck)" >&2; exit 2 ;;
esac
exit $fail
