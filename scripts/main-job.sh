#!/usr/bin/env bash
# The main job behind `make run`.
set -euo pipefail
bin=${1:-build/spillway}
exec "$bin" --help
