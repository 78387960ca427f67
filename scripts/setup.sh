#!/usr/bin/env bash
# Creates .venv (unless present), installs torch 2.13.0 CPU unless torch is already importable,
# the dependencies, and builds ciuicflow's native extension against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip setuptools wheel
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  python -m pip install --quiet torch==2.13.0 numpy
fi
echo "[setup] installing ciuicflow and its dependencies, building the extension (a minute or two)"
DS_BUILD_OPS=${DS_BUILD_OPS:-0} python -m pip install --quiet --no-build-isolation -e ".[test${CIUICFLOW_EXTRAS:+,$CIUICFLOW_EXTRAS}]"
python -c "import ciuicflow.ops, torch; print('[setup] ready: torch', torch.__version__, '| CUDA kernels:', ciuicflow.ops.has_cuda_kernels())"
