// CUDA kernels of the ciuicflow ops (see kernels.cuh). Semantics match csrc/cpu/ exactly; only the
// order of floating-point sums differs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.cuh"

namespace ciuicflow {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Sum over the block; every thread gets the result.
__device__ float block_sum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // shared may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += shared[w];
  return total;
}

// One block per chunk. Pass 1 finds scale = mean|y|, y = x + decay * err_in; pass 2 writes the
// sign bits with a warp ballot (32 elements -> 4 bytes, written by lanes 0..3) and the new error
// into err (err_in and err may be one buffer: each thread reads an element before writing it).
// sums (or null): += (sum new_error^2, sum x^2) of the block, in float64.
template <typename T>
__global__ void onebit_pack_kernel(const T* __restrict__ x, const float* err_in, float decay,
                                   float* err, uint8_t* __restrict__ packed,
                                   float* __restrict__ scales, double* __restrict__ sums,
                                   int64_t n, int64_t chunk) {
  __shared__ float shared[kWarps];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t len = min(chunk, n - begin);
  float local = 0.0f, x2 = 0.0f, e2 = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const float v = to_float(x[begin + i]);
    local += fabsf(__fadd_rn(v, __fmul_rn(decay, err_in[begin + i])));  // no fused multiply-add:
    x2 += v * v;                                                         // the CPU's rounding
  }
  const float scale = block_sum(local, shared) / static_cast<float>(len);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  const int lane = threadIdx.x % 32;
  const int64_t nbytes = (len + 7) / 8;
  for (int64_t base = 0; base < len; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    bool positive = false;
    if (i < len) {
      const float y = __fadd_rn(to_float(x[begin + i]), __fmul_rn(decay, err_in[begin + i]));
      positive = y >= 0.0f;
      const float e = y - (positive ? scale : -scale);
      err[begin + i] = e;
      e2 += e * e;
    }
    const unsigned bits = __ballot_sync(0xffffffffu, positive);
    const int64_t byte = (base + threadIdx.x - lane) / 8 + lane;  // warp's first byte + lane
    if (lane < 4 && byte < nbytes) packed[begin / 8 + byte] = (bits >> (8 * lane)) & 0xffu;
  }
  if (sums != nullptr) {
    e2 = block_sum(e2, shared);
    x2 = block_sum(x2, shared);
    if (threadIdx.x == 0) {
      atomicAdd(sums, static_cast<double>(e2));
      atomicAdd(sums + 1, static_cast<double>(x2));
    }
  }
}

__device__ __forceinline__ float unpack_one(const uint8_t* packed, const float* scales, int64_t i,
                                            int64_t chunk) {
  const float scale = scales[i / chunk];
  return ((packed[i >> 3] >> (i & 7)) & 1) ? scale : -scale;
}

__global__ void onebit_unpack_kernel(const uint8_t* __restrict__ packed,
                                     const float* __restrict__ scales, float* __restrict__ out,
                                     int64_t n, int64_t chunk) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = unpack_one(packed, scales, i, chunk);
  }
}

__global__ void onebit_unpack_mean_kernel(const uint8_t* __restrict__ packed,
                                          const float* __restrict__ scales,
                                          float* __restrict__ out, int64_t world, int64_t n,
                                          int64_t chunk) {
  const int64_t nbytes = (n + 7) / 8, nchunks = (n + chunk - 1) / chunk;
  const float inv_world = 1.0f / static_cast<float>(world);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;  // rank order, as on the CPU
    for (int64_t w = 0; w < world; ++w) {
      sum += unpack_one(packed + w * nbytes, scales + w * nchunks, i, chunk);
    }
    out[i] = sum * inv_world;
  }
}

// One block per matrix; columns are processed in order, each dot product a block reduction.
__global__ void gram_schmidt_kernel(float* __restrict__ rows, int64_t r, int64_t n, float eps) {
  __shared__ float shared[kWarps];
  float* m = rows + static_cast<int64_t>(blockIdx.x) * r * n;
  for (int64_t i = 0; i < r; ++i) {
    float* col = m + i * n;
    float sq = 0.0f;
    for (int64_t k = threadIdx.x; k < n; k += kThreads) sq += col[k] * col[k];
    const float denom = sqrtf(block_sum(sq, shared)) + eps;
    if (denom != 0.0f) {  // a zero column stays zero
      for (int64_t k = threadIdx.x; k < n; k += kThreads) col[k] /= denom;
    }
    __syncthreads();
    for (int64_t j = i + 1; j < r; ++j) {
      float* other = m + j * n;
      float dot = 0.0f;
      for (int64_t k = threadIdx.x; k < n; k += kThreads) dot += col[k] * other[k];
      dot = block_sum(dot, shared);
      for (int64_t k = threadIdx.x; k < n; k += kThreads) other[k] -= dot * col[k];
    }
    __syncthreads();
  }
}

// Tall matrices: one block per matrix leaves most SMs idle (a 16M x 4 matrix would use 1 of an
// H200's 132), so a large n is split over several blocks (grid.x: slices of the rows, grid.y: the
// matrices) and the columns are processed in order, two launches each. Every reduction sums per-block partials
// in a fixed order (no atomics), so the result is the same on every run and every rank.
constexpr int64_t kRowsPerBlock = 16384;  // below this many rows one block per matrix is enough
constexpr int64_t kMaxBlocksPerMatrix = 256;

int64_t blocks_per_matrix(int64_t n) {
  const int64_t blocks = n / kRowsPerBlock;
  return blocks < 1 ? 1 : (blocks > kMaxBlocksPerMatrix ? kMaxBlocksPerMatrix : blocks);
}

// For column `done` (if >= 0): q = col * inv, then other -= coef[j] * q for every later column j
// (coefs[b, j] from gram_schmidt_coefs_kernel). Then, for column `next` = done + 1 (if < r): this
// block's partial dot products of it with itself and with every later column, into
// partials[b, block, j] (j >= next).
__global__ void gram_schmidt_update_kernel(float* __restrict__ rows, int64_t r, int64_t n,
                                           int64_t done, const float* __restrict__ coefs,
                                           float* __restrict__ partials) {
  __shared__ float shared[kWarps];
  float* m = rows + static_cast<int64_t>(blockIdx.y) * r * n;
  const float* coef = coefs + static_cast<int64_t>(blockIdx.y) * r;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (done >= 0) {
    const float inv = coef[done];
    float* col = m + done * n;
    for (int64_t k = first; k < n; k += stride) {
      const float q = col[k] * inv;
      col[k] = q;
      for (int64_t j = done + 1; j < r; ++j) m[j * n + k] -= coef[j] * q;
    }
  }
  const int64_t next = done + 1;
  if (next >= r) return;
  const float* col = m + next * n;
  float* out = partials + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * r;
  for (int64_t j = next; j < r; ++j) {
    const float* other = m + j * n;
    float dot = 0.0f;
    // the same thread touched these elements above: its own writes are visible to it
    for (int64_t k = first; k < n; k += stride) dot += col[k] * other[k];
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) out[j] = dot;
  }
}

// One block per matrix: sums the partials of column i (fixed order, in double) and writes
// coefs[b, i] = 1 / (||col|| + eps) (1 for a zero column, which stays zero) and, for later
// columns j, coefs[b, j] = <q, other_j>, the amount of q to take out of column j.
__global__ void gram_schmidt_coefs_kernel(const float* __restrict__ partials, int64_t blocks,
                                          int64_t r, int64_t i, float eps,
                                          float* __restrict__ coefs) {
  const float* part = partials + static_cast<int64_t>(blockIdx.x) * blocks * r;
  float* coef = coefs + static_cast<int64_t>(blockIdx.x) * r;
  __shared__ float inv_shared;
  if (threadIdx.x == 0) {
    double sq = 0;
    for (int64_t b = 0; b < blocks; ++b) sq += part[b * r + i];
    const double denom = sqrt(sq) + eps;
    inv_shared = denom != 0.0 ? static_cast<float>(1.0 / denom) : 1.0f;
    coef[i] = inv_shared;
  }
  __syncthreads();
  for (int64_t j = i + 1 + threadIdx.x; j < r; j += blockDim.x) {
    double dot = 0;
    for (int64_t b = 0; b < blocks; ++b) dot += part[b * r + j];
    coef[j] = static_cast<float>(dot) * inv_shared;  // <col, other> / (||col|| + eps)
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace

cudaError_t onebit_pack(const void* x, ElemType type, const float* err_in, float decay,
                        float* err, uint8_t* packed, float* scales, double* sums, int64_t n,
                        int64_t chunk, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((n + chunk - 1) / chunk);
  switch (type) {
    case ElemType::kFloat32:
      onebit_pack_kernel<<<blocks, kThreads, 0, stream>>>(
          static_cast<const float*>(x), err_in, decay, err, packed, scales, sums, n, chunk);
      break;
    case ElemType::kFloat16:
      onebit_pack_kernel<<<blocks, kThreads, 0, stream>>>(
          static_cast<const __half*>(x), err_in, decay, err, packed, scales, sums, n, chunk);
      break;
    case ElemType::kBFloat16:
      onebit_pack_kernel<<<blocks, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), err_in, decay, err, packed, scales, sums, n,
          chunk);
      break;
  }
  return cudaGetLastError();
}

cudaError_t onebit_unpack(const uint8_t* packed, const float* scales, float* out, int64_t n,
                          int64_t chunk, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  onebit_unpack_kernel<<<grid_for(n), kThreads, 0, stream>>>(packed, scales, out, n, chunk);
  return cudaGetLastError();
}

cudaError_t onebit_unpack_mean(const uint8_t* packed, const float* scales, float* out,
                               int64_t world, int64_t n, int64_t chunk, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  onebit_unpack_mean_kernel<<<grid_for(n), kThreads, 0, stream>>>(packed, scales, out, world, n,
                                                                  chunk);
  return cudaGetLastError();
}

int64_t gram_schmidt_workspace_floats(int64_t batch, int64_t r, int64_t n) {
  const int64_t blocks = blocks_per_matrix(n);
  if (blocks == 1 || batch > 65535) return 0;  // one block per matrix: no workspace
  return batch * blocks * r + batch * r;        // partials, then coefs
}

cudaError_t gram_schmidt_rows(float* rows, int64_t batch, int64_t r, int64_t n, float eps,
                              float* workspace, cudaStream_t stream) {
  if (batch == 0 || r == 0 || n == 0) return cudaSuccess;
  const int64_t blocks = blocks_per_matrix(n);
  if (gram_schmidt_workspace_floats(batch, r, n) == 0) {
    gram_schmidt_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(rows, r, n, eps);
    return cudaGetLastError();
  }
  float* partials = workspace;
  float* coefs = workspace + batch * blocks * r;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(batch));
  gram_schmidt_update_kernel<<<grid, kThreads, 0, stream>>>(rows, r, n, -1, coefs, partials);
  for (int64_t i = 0; i < r; ++i) {
    gram_schmidt_coefs_kernel<<<static_cast<unsigned>(batch), 32, 0, stream>>>(
        partials, blocks, r, i, eps, coefs);
    gram_schmidt_update_kernel<<<grid, kThreads, 0, stream>>>(rows, r, n, i, coefs, partials);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ciuicflow
