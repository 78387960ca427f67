// CIUICFLOW_HD: a function the CPU and CUDA kernels share (host and device under nvcc).
#pragma once

#if defined(__CUDACC__)
#define CIUICFLOW_HD __host__ __device__
#else
#define CIUICFLOW_HD
#endif
