#!/usr/bin/env bash
# Installs, from Debian 12's packages, whatever Spillway needs to build and test
# that this machine lacks. Run by `make run` and `make test`; safe to run twice.
set -euo pipefail
packages=(
  build-essential cmake make pkg-config git
  liburing-dev libopenblas-dev
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev libpcre2-dev
  python3
  clang libclang-rt-14-dev llvm  # make fuzz: clang with libFuzzer, llvm-symbolizer for sanitizer stacks
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq || { echo "install-deps: apt-get update failed" >&2; exit 1; }
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" \
  || { echo "install-deps: apt-get install failed for: ${missing[*]}" >&2; exit 1; }
