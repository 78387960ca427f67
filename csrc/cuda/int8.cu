// CUDA kernels and registration of the int8 ops: one thread block per chunk for the pack (a block
// reduction for the scale), one thread per element for the unpacks. Products and sums use the _rn
// intrinsics so nvcc does not fuse them into FMAs: the bits match the CPU kernels.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../int8_common.h"

namespace ciuicflow {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__device__ inline float to_float(scalar_t v) { return static_cast<float>(v); }
template <>
__device__ inline float to_float<c10::Half>(c10::Half v) { return __half2float(static_cast<__half>(v)); }
template <>
__device__ inline float to_float<c10::BFloat16>(c10::BFloat16 v) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&v));
}

template <typename scalar_t>
__global__ void pack_kernel(const scalar_t* __restrict__ x, float* __restrict__ err,
                            int8_t* __restrict__ q, float* __restrict__ scales, int64_t n,
                            int64_t chunk) {
  __shared__ float amax_shared[kThreads];
  __shared__ int nan_shared[kThreads];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  float amax = 0.0f;
  int nan = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float y = __fadd_rn(to_float(x[i]), err[i]);
    err[i] = y;
    const float a = fabsf(y);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  amax_shared[threadIdx.x] = amax;
  nan_shared[threadIdx.x] = nan;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float other = amax_shared[threadIdx.x + stride];
      amax_shared[threadIdx.x] = other > amax_shared[threadIdx.x] ? other : amax_shared[threadIdx.x];
      nan_shared[threadIdx.x] |= nan_shared[threadIdx.x + stride];
    }
    __syncthreads();
  }
  const float s = nan_shared[0] ? NAN : __fdiv_rn(amax_shared[0], int8q::kLevels);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float y = err[i];
    const int8_t v = int8q::quantize(y, s);
    q[i] = v;
    err[i] = __fsub_rn(y, __fmul_rn(static_cast<float>(v), s));
  }
}

__global__ void unpack_mean_kernel(const int8_t* __restrict__ v, const float* __restrict__ s,
                                   float* __restrict__ out, int64_t world, int64_t n,
                                   int64_t chunk) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const float inv_world = __fdiv_rn(1.0f, static_cast<float>(world));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;  // row order, as on the CPU
    for (int64_t w = 0; w < world; ++w) {
      sum = __fadd_rn(sum, __fmul_rn(static_cast<float>(v[w * n + i]), s[w * nchunks + i / chunk]));
    }
    out[i] = __fmul_rn(sum, inv_world);
  }
}

void check_launch(const char* op) {
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(status));
}

std::tuple<at::Tensor, at::Tensor> int8_pack_cuda(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  int8q::check_pack(x, error, chunk_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nchunks = int8q::chunks(n, chunk_size);
  auto xc = x.contiguous();
  auto q = at::empty({n}, x.options().dtype(at::kChar));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  if (n == 0) return {q, scales};
  TORCH_CHECK(nchunks <= 0x7fffffff, "int8_pack: too many chunks for one launch: ", nchunks);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "int8_pack", [&] {
    pack_kernel<scalar_t><<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(
        xc.const_data_ptr<scalar_t>(), error.data_ptr<float>(), q.data_ptr<int8_t>(),
        scales.data_ptr<float>(), n, chunk_size);
  });
  check_launch("int8_pack");
  return {q, scales};
}

void unpack_rows_cuda(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                      int64_t chunk_size, at::Tensor& out, int64_t world) {
  const c10::cuda::CUDAGuard guard(values.device());
  if (numel == 0) return;
  auto vc = values.contiguous();
  auto sc = scales.contiguous();
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
  unpack_mean_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                       c10::cuda::getCurrentCUDAStream()>>>(
      vc.const_data_ptr<int8_t>(), sc.const_data_ptr<float>(), out.data_ptr<float>(), world,
      numel, chunk_size);
  check_launch("int8_unpack");
}

void int8_unpack_into_cuda(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                           int64_t chunk_size, at::Tensor& out) {
  int8q::check_unpack("int8_unpack", values, scales, numel, chunk_size, 1, out);
  unpack_rows_cuda(values, scales, numel, chunk_size, out, 1);
}

void int8_unpack_mean_into_cuda(const at::Tensor& values, const at::Tensor& scales,
                                int64_t numel, int64_t chunk_size, at::Tensor& out) {
  int8q::check_unpack("int8_unpack_mean", values, scales, numel, chunk_size, 2, out);
  unpack_rows_cuda(values, scales, numel, chunk_size, out, values.size(0));
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CUDA, m) {
  m.impl("int8_pack", &int8_pack_cuda);
  m.impl("int8_unpack_into", &int8_unpack_into_cuda);
  m.impl("int8_unpack_mean_into", &int8_unpack_mean_into_cuda);
}

}  // namespace ciuicflow
