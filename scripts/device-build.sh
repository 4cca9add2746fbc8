#!/usr/bin/env bash
# Builds Spillway on the lent GPU machine (Ubuntu, no liburing/xxhash headers):
# unpacks the Debian packages carried in .deps/ into .deps/prefix, then configures
# and builds with ninja into build-device/ (or $BUILD_DIR). Usage: scripts/device-build.sh [targets...]
# CUDA_DEFINES (-D flags for an experiment's #ifdef) is passed to nvcc,
# for a second build to compare against in the same call.
# .deps/ is not committed: on the dev box, before the device call, run
#   mkdir -p .deps && (cd .deps && apt-get download liburing-dev liburing2 libxxhash-dev libxxhash0 libpcre2-dev)
# and name .deps in the device tool's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ls .deps/*.deb >/dev/null 2>&1; then
  echo "device-build: .deps/*.deb missing; see the comment at the top of $0" >&2
  exit 1
fi
prefix=$PWD/.deps/prefix
if [ ! -d "$prefix/usr/include" ]; then
  for f in .deps/*.deb; do dpkg -x "$f" "$prefix"; done
fi
build=${BUILD_DIR:-build-device}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS="${CUDA_DEFINES:-}" \
  -DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DXXHASH_INCLUDE_DIR="$prefix/usr/include" \
  -DURING_INCLUDE_DIR="$prefix/usr/include" -DURING_LIBRARY="$prefix/usr/lib/x86_64-linux-gnu/liburing.a" \
  -DPCRE2_INCLUDE_DIR="$prefix/usr/include" -DPCRE2_LIBRARY="$prefix/usr/lib/x86_64-linux-gnu/libpcre2-8.a" >/dev/null
cmake --build "$build" -j "$(nproc)" ${1:+--target "$@"}
