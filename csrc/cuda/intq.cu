// CUDA kernels and registration of the integer quantisation ops (int8, int4): one thread block per
// chunk for the pack (a block reduction for the scale, then one thread per payload byte), one
// thread per element for the unpacks. Products and sums use the _rn intrinsics so nvcc does not
// fuse them into FMAs: the bits match the CPU kernels.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../intq_common.h"
#include "to_float.cuh"

namespace ciuicflow {
namespace {

constexpr int kThreads = 256;

template <typename F, typename scalar_t>
__global__ void pack_kernel(const scalar_t* __restrict__ x, float* __restrict__ err,
                            uint8_t* __restrict__ bytes, float* __restrict__ scales, int64_t n,
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
  const float s = nan_shared[0] ? NAN : __fdiv_rn(amax_shared[0], F::kLevels);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  constexpr int kPer = intq::per_byte<F>();
  // chunk is a multiple of kPer: this block's bytes are its own
  for (int64_t b = begin / kPer + threadIdx.x; b * kPer < end; b += kThreads) {
    uint32_t byte = 0;
    for (int k = 0; k < kPer && b * kPer + k < end; ++k) {
      const int64_t i = b * kPer + k;
      const float y = err[i];
      const int v = intq::quantize<F>(y, s);
      byte |= intq::place<F>(v, k);
      err[i] = __fsub_rn(y, __fmul_rn(static_cast<float>(v), s));
    }
    bytes[b] = static_cast<uint8_t>(byte);
  }
}

template <typename F>
__global__ void unpack_mean_kernel(const uint8_t* __restrict__ v, const float* __restrict__ s,
                                   float* __restrict__ out, int64_t world, int64_t n,
                                   int64_t row_bytes, int64_t chunk) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const float inv_world = __fdiv_rn(1.0f, static_cast<float>(world));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;  // row order, as on the CPU
    for (int64_t w = 0; w < world; ++w) {
      const float value = static_cast<float>(intq::decode<F>(v + w * row_bytes, i));
      sum = __fadd_rn(sum, __fmul_rn(value, s[w * nchunks + i / chunk]));
    }
    out[i] = __fmul_rn(sum, inv_world);
  }
}

void check_launch(const char* op) {
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(status));
}

template <typename F>
std::tuple<at::Tensor, at::Tensor> pack_cuda(const at::Tensor& x, at::Tensor& error,
                                             int64_t chunk_size) {
  intq::check_pack<F>(x, error, chunk_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nchunks = intq::chunks(n, chunk_size);
  auto xc = x.contiguous();
  auto values = at::empty({intq::payload_bytes<F>(n)}, x.options().dtype(F::kDtype));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  if (n == 0) return {values, scales};
  TORCH_CHECK(nchunks <= 0x7fffffff, F::kName, "_pack: too many chunks for one launch: ", nchunks);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "intq_pack", [&] {
    pack_kernel<F, scalar_t><<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(
        xc.const_data_ptr<scalar_t>(), error.data_ptr<float>(),
        static_cast<uint8_t*>(values.data_ptr()), scales.data_ptr<float>(), n, chunk_size);
  });
  check_launch(F::kName);
  return {values, scales};
}

template <typename F>
void unpack_rows_cuda(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                      int64_t chunk_size, at::Tensor& out, int64_t world) {
  const c10::cuda::CUDAGuard guard(values.device());
  if (numel == 0) return;
  auto vc = values.contiguous();
  auto sc = scales.contiguous();
  const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
  unpack_mean_kernel<F><<<static_cast<unsigned>(blocks), kThreads, 0,
                          c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(vc.const_data_ptr()), sc.const_data_ptr<float>(),
      out.data_ptr<float>(), world, numel, intq::payload_bytes<F>(numel), chunk_size);
  check_launch(F::kUnpack);
}

template <typename F>
void unpack_into_cuda(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                      int64_t chunk_size, at::Tensor& out) {
  intq::check_unpack<F>(F::kUnpack, values, scales, numel, chunk_size, 1, out);
  unpack_rows_cuda<F>(values, scales, numel, chunk_size, out, 1);
}

template <typename F>
void unpack_mean_into_cuda(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                           int64_t chunk_size, at::Tensor& out) {
  intq::check_unpack<F>(F::kUnpackMean, values, scales, numel, chunk_size, 2, out);
  unpack_rows_cuda<F>(values, scales, numel, chunk_size, out, values.size(0));
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CUDA, m) {
  m.impl("int8_pack", &pack_cuda<intq::Int8>);
  m.impl("int8_unpack_into", &unpack_into_cuda<intq::Int8>);
  m.impl("int8_unpack_mean_into", &unpack_mean_into_cuda<intq::Int8>);
  m.impl("int4_pack", &pack_cuda<intq::Int4>);
  m.impl("int4_unpack_into", &unpack_into_cuda<intq::Int4>);
  m.impl("int4_unpack_mean_into", &unpack_mean_into_cuda<intq::Int4>);
}

}  // namespace ciuicflow
