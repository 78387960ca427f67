"""Builds ciuicflow._C, the native ops, against the torch that is already installed.

CppExtension by default; CUDAExtension when torch has CUDA and nvcc is found.
CIUICFLOW_CUDA=1 forces the CUDA build, CIUICFLOW_CUDA=0 forbids it.
"""
import glob
import os
import shutil

from setuptools import setup
from torch.utils import cpp_extension


def want_cuda() -> bool:
    forced = os.environ.get("CIUICFLOW_CUDA")
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    import torch

    return torch.version.cuda is not None and (
        cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    )


def extension():
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-fopenmp", "-std=c++20"]
    if os.environ.get("CIUICFLOW_NATIVE", "0") == "1":
        cxx.append("-march=native")  # opt-in only: wheels must run on any x86-64
    common = dict(
        name="ciuicflow._C",
        include_dirs=[os.path.abspath("csrc")],
        extra_link_args=["-fopenmp"],
        py_limited_api=False,
    )
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
        nvcc = ["-O3", "-std=c++17"]
        return cpp_extension.CUDAExtension(
            sources=sources,
            extra_compile_args={"cxx": cxx + ["-DCIUICFLOW_WITH_CUDA"], "nvcc": nvcc},
            **common,
        )
    return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **common)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
