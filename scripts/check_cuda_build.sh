#!/usr/bin/env bash
# Compiles the CUDA kernels with nvcc alone for sm_80 and sm_90 (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null; then
  echo "[cuda-build] nvcc not found: CUDA kernels NOT checked" >&2
  exit 1
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for arch in 80 90; do
  "$NVCC" -std=c++17 -O3 -Werror all-warnings -gencode "arch=compute_${arch},code=sm_${arch}" \
    -c csrc/cuda/kernels.cu -o "$out/kernels_sm${arch}.o"
  echo "[cuda-build] csrc/cuda/kernels.cu compiles for sm_${arch}"
done
