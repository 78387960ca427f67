#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main demo: 2 simulated nodes x 2 ranks, every hook.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ciuicflow demo "$@"
