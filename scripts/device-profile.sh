#!/usr/bin/env bash
# On the lent GPU machine: builds spillway (scripts/device-build.sh), profiles the
# machine twice (`spillway profile`: the two files should agree within noise), then
# plans gpt2-1.5b at 24 GiB with the h200 preset and with the measured machine,
# sweeps the link rate, and times the same run (bench train) with the measured
# machine, so predicted and measured steps sit side by side. Outputs in $OUT
# (default /tmp/device-profile): profile-1.txt, h200-measured-1.json, ... summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device-profile}
mkdir -p "$out" /tmp/spill
scripts/device-build.sh spillway > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
bin=build-device/spillway
for i in 1 2; do
  timeout 150 $bin profile --backend cuda --spill-dir /tmp/spill --out "$out/h200-measured-$i.json" 2>&1 |
    tee "$out/profile-$i.txt"
done
measured=$out/h200-measured-1.json
{
  for m in h200 "$measured"; do
    echo "== plan gpt2-1.5b, 24 GiB, machine $m"
    timeout 60 $bin simulate --machine "$m" --model gpt2-1.5b --batch 8 --accum 2 --device-budget 24GiB \
      --policy planned | tail -3
  done
  echo "== sweep of the link rate, measured machine"
  timeout 120 $bin simulate --machine "$measured" --model gpt2-1.5b --batch 8 --accum 2 --device-budget 24GiB \
    --policy planned --sweep h2d-gbps=25,55,110 --chart "$out/h2d.svg"
  echo "== measured: the same run"
  timeout 150 $bin bench train --backend cuda --model gpt2-1.5b --batch 8 --accum 2 --steps 3 --device-budget 24GiB \
    --policy planned --machine "$measured" 2>&1
} 2>&1 | tee "$out/summary.txt"
