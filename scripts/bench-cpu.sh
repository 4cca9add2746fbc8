#!/usr/bin/env bash
# CPU training benchmarks behind bench/RESULTS.md (issues 3 and 4): tokens/s and
# stall share per policy and device budget. Usage: scripts/bench-cpu.sh [build/spillway]
set -uo pipefail
bin=${1:-build/spillway}
row() {  # label, then bench train flags
  local label=$1; shift
  local out
  out=$("$bin" bench train --backend cpu "$@" 2>&1)
  if [ $? -ne 0 ]; then echo "| $label | error: $(echo "$out" | tail -1) |"; return; fi
  local tps stall dev
  tps=$(echo "$out" | awk '/^tokens\/s/ {print $2}')
  stall=$(echo "$out" | awk '/^compute stalled/ {print $3}')
  dev=$(echo "$out" | awk '/^peaks/ {print $3, $4}')
  echo "| $label | $tps | $stall | $dev |"
}
echo "| run | tokens/s | compute stalled | device peak |"
echo "| --- | ---: | ---: | ---: |"
row "tiny, resident, 16×64" --model tiny --batch 16 --context 64 --steps 4 --policy resident
row "gpt2-124m, resident, 1×128" --model gpt2-124m --batch 1 --context 128 --steps 3 --policy resident
peak=$("$bin" plan --machine cpu --model gpt2-124m --batch 1 --context 128 --policy resident | awk '/^memory peak/ {print $4 $5}')
echo "<!-- resident device peak: $peak -->"
for frac in 2 4 10; do
  bytes=$("$bin" plan --machine cpu --model gpt2-124m --batch 1 --context 128 --policy resident |
          awk -v f=$frac '/^memory peak/ {v=$4; u=$5; m=(u=="GiB")?1073741824:(u=="MiB")?1048576:1024; printf "%d", v*m/f}')
  for policy in paging "paging --prefetch learned" planned auto; do
    row "gpt2-124m, $policy, budget 1/$frac ($((bytes / 1048576)) MiB)" --model gpt2-124m --batch 1 --context 128 \
      --steps 3 --device-budget "$bytes" --policy $policy
  done
done
