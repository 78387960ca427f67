// Launchers of ciuicflow's CUDA kernels. Plain CUDA, no torch headers: kernels.cu compiles with
// nvcc alone (CI checks sm_80 and sm_90 on a machine with no GPU).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace ciuicflow {
namespace cuda {

enum class ElemType { kFloat32, kFloat16, kBFloat16 };

// x: n elements of `type`; err = x + decay * err_in - what was packed (float32; err_in may be
// err); packed: ceil(n/8) bytes; scales: ceil(n/chunk) floats; sums (or null): two float64,
// += (sum err^2, sum x^2). chunk is a positive multiple of 8.
cudaError_t onebit_pack(const void* x, ElemType type, const float* err_in, float decay,
                        float* err, uint8_t* packed, float* scales, double* sums, int64_t n,
                        int64_t chunk, cudaStream_t stream);

cudaError_t onebit_unpack(const uint8_t* packed, const float* scales, float* out, int64_t n,
                          int64_t chunk, cudaStream_t stream);

// packed [world, ceil(n/8)], scales [world, ceil(n/chunk)] -> out = mean over world.
cudaError_t onebit_unpack_mean(const uint8_t* packed, const float* scales, float* out,
                               int64_t world, int64_t n, int64_t chunk, cudaStream_t stream);

// rows: [batch, r, n] float32, each row one column of the matrix; orthonormalised in place.
// workspace: gram_schmidt_workspace_floats(batch, r, n) floats on the device (0: may be null).
int64_t gram_schmidt_workspace_floats(int64_t batch, int64_t r, int64_t n);
cudaError_t gram_schmidt_rows(float* rows, int64_t batch, int64_t r, int64_t n, float eps,
                              float* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace ciuicflow
