"""The devices the op tests run on: the CPU always, CUDA where a device and this build's CUDA
kernels both exist; otherwise a visible skip that names which of the two is missing."""
import pytest
import torch

import ciuicflow.ops as ops


def cuda_skip_reason() -> str | None:
    """None when the CUDA kernels can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not ops.has_cuda_kernels():
        return ("CUDA is available but this build of ciuicflow has no CUDA kernels "
                "(rebuild with CIUICFLOW_CUDA=1)")
    return None


CUDA_SKIP_REASON = cuda_skip_reason()
DEVICES = ["cpu", "cuda" if CUDA_SKIP_REASON is None else
           pytest.param("cuda", marks=pytest.mark.skip(reason=CUDA_SKIP_REASON))]
needs_cuda = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=CUDA_SKIP_REASON or "")
