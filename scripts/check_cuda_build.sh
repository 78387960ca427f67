#!/usr/bin/env bash
# Compiles the CUDA side of the extension as its build would (no GPU needed): every csrc/cuda/*.cu
# with nvcc for sm_80 and sm_90, and every csrc/cuda/*.cpp (the CUDA registrations) with the host
# compiler, both against the installed torch's ATen/c10 headers. A broken kernel, template or
# dispatch registration fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null; then
  echo "[cuda-build] nvcc not found: CUDA kernels NOT checked" >&2
  exit 1
fi
PY=${PYTHON:-python}
# where nvcc really lives (it may be a wrapper script elsewhere): its dry run names it
cuda_home=${CUDA_HOME:-$("$NVCC" --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)}
mapfile -t includes < <("$PY" - <<'PYEOF'
from torch.utils import cpp_extension
for path in cpp_extension.include_paths():
    print(path)
PYEOF
)
abi=$("$PY" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
# our headers with warnings as errors; torch's, CUDA's and Python's as system headers
flags=(-DCIUICFLOW_WITH_CUDA "-D_GLIBCXX_USE_CXX11_ABI=$abi" -Icsrc -isystem "$cuda_home/include")
for dir in "${includes[@]}"; do flags+=(-isystem "$dir"); done
flags+=(-isystem "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# A CPU wheel of torch lacks the one header that CMake generates for c10's CUDA library; CUDA
# wheels ship it. Its content is fixed: stand in for it so the same sources compile here.
if ! ls "${includes[0]}/c10/cuda/impl/cuda_cmake_macros.h" >/dev/null 2>&1; then
  mkdir -p "$out/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  flags+=(-isystem "$out/stub")
fi
# One nvcc per source for both architectures (the host side, most of the time, is parsed once),
# two sources at a time (CI's two cores); any failure fails the script.
compile() {
  "$NVCC" -std=c++17 -O3 -Werror all-warnings -gencode arch=compute_80,code=sm_80 \
    -gencode arch=compute_90,code=sm_90 "${flags[@]}" -c "$1" -o "$out/$(basename "$1").o"
  echo "[cuda-build] $1 compiles for sm_80 and sm_90"
}
pids=()
for source in csrc/cuda/*.cu; do
  if [ "${#pids[@]}" -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  compile "$source" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for source in csrc/cuda/*.cpp; do
  "${CXX:-g++}" -std=c++20 -O1 -fsyntax-only -Wall -Werror "${flags[@]}" "$source"
  echo "[cuda-build] $source compiles (host side)"
done
