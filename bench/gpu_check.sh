#!/usr/bin/env bash
# One call on a GPU machine (offline: the machine's own torch, nothing fetched): install ciuicflow
# with its CUDA kernels, run every CUDA test (full log kept), benchmark the kernels (each op vs
# plain torch vs a device copy of the same bytes, orthogonalize_ vs torch.linalg.qr) and the hooks
# on one GPU. Everything lands in $OUT (default ./out): gpu.txt, install.log, tests.log,
# tests.xml, kernels_cuda.{json,md}, gpu_hooks.{json,md}, summary.txt. Exits 1 if any step failed,
# after running the others. Well inside 10 minutes on an H200.
#
#   OUT=out bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
failed=()
step() { echo "== [$SECONDS s] $*" | tee -a "$OUT/summary.txt"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee -a "$OUT/gpu.txt"

step "install (CUDA build for this GPU's architecture)"
arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
if CIUICFLOW_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=16 \
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . > "$OUT/install.log" 2>&1 \
  && "$PY" -c "import ciuicflow.ops as o; assert o.has_cuda_kernels(), 'no CUDA kernels in the build'"; then
  echo "installed, CUDA kernels for sm_${arch/./}" | tee -a "$OUT/summary.txt"
else
  tail -40 "$OUT/install.log"
  echo "install FAILED (see install.log)" | tee -a "$OUT/summary.txt"
  exit 1
fi

step "CUDA tests (every op on CUDA against the CPU reference; every hook and optimizer on the GPU against the CPU)"
"$PY" -m pytest -v -ra -p no:cacheprovider --junitxml="$OUT/tests.xml" \
  tests/test_ops.py tests/test_int8.py tests/test_int4.py tests/test_gpu.py > "$OUT/tests.log" 2>&1 || failed+=(tests)
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -15 | tee -a "$OUT/summary.txt"

step "kernels (64M elements)"
"$PY" -m bench.kernels --device cuda --repeats 20 --json "$OUT/kernels_cuda.json" \
  > "$OUT/kernels_cuda.md" 2> "$OUT/kernels_cuda.log" || { failed+=(kernels); tail -20 "$OUT/kernels_cuda.log"; }

step "hooks on one GPU (4 processes, gloo)"
"$PY" -m bench.gpu.hooks --json "$OUT/gpu_hooks.json" > "$OUT/gpu_hooks.log" 2>&1 \
  || { failed+=(hooks); tail -20 "$OUT/gpu_hooks.log"; }

step "done; failed: ${failed[*]:-none}"
cat "$OUT/kernels_cuda.md" "$OUT/gpu_hooks.md" 2>/dev/null
[ ${#failed[@]} -eq 0 ]
