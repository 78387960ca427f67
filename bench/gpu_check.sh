#!/usr/bin/env bash
# One call on a GPU machine: build the CUDA extension, run the op tests (CUDA against the CPU
# reference), and benchmark the kernels on the device. Results land in $OUT (or ./out).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== build (CUDA)"
CIUICFLOW_CUDA=1 MAX_JOBS=16 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
"$PY" -c "import ciuicflow.ops as o; assert o.has_cuda_kernels(), 'no CUDA kernels in the build'; print('CUDA kernels: yes')"
echo "== tests (CUDA vs CPU reference)"
"$PY" -m pytest -q -x tests/test_ops.py -p no:cacheprovider 2>&1 | tail -5
echo "== benchmark"
"$PY" bench/kernels.py --device cuda --repeats 20 --json "$OUT/kernels_cuda.json" | tee "$OUT/kernels_cuda.md"
