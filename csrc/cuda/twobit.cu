// CUDA kernel and registration of the 2-bit pack (ciuicflow/compression/twobit.py has the format):
// one thread block per chunk: a block sum of y^2 for the RMS, block sums of the magnitudes, then
// one thread per byte of codes. The chunk's magnitudes from its sums are twobit_common.h's, as on
// the CPU; the sums run in another order than the CPU's, so a scale may differ in its last bit (as
// the torch-ops pack's does). Products and sums use the _rn intrinsics: no fused multiply-adds.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../twobit_common.h"
#include "to_float.cuh"

namespace ciuicflow {
namespace {

constexpr int kThreads = 256;

// The sum of every thread's v (all threads of the block call it); shared is kThreads floats.
__device__ float block_sum(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] = __fadd_rn(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();  // shared is reused by the next call
  return total;
}

template <typename scalar_t>
__global__ void twobit_pack_kernel(const scalar_t* __restrict__ x, float* __restrict__ err,
                                   uint8_t* __restrict__ payload, float* __restrict__ scales,
                                   int64_t n, int64_t chunk) {
  __shared__ float shared[kThreads];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t len = begin + chunk < n ? chunk : n - begin;
  float* e = err + begin;
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const float y = __fadd_rn(to_float(x[begin + i]), e[i]);
    e[i] = y;
    squares = __fadd_rn(squares, __fmul_rn(y, y));
  }
  const float rms = sqrtf(__fdiv_rn(block_sum(squares, shared), static_cast<float>(len)));
  const float threshold = __fmul_rn(twobit::kThreshold, rms);
  float sum_all = 0.0f, sum_large = 0.0f, n_large = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const float a = fabsf(e[i]);
    sum_all = __fadd_rn(sum_all, a);
    if (a > threshold) {
      sum_large = __fadd_rn(sum_large, a);
      n_large = __fadd_rn(n_large, 1.0f);
    }
  }
  sum_all = block_sum(sum_all, shared);
  sum_large = block_sum(sum_large, shared);
  n_large = block_sum(n_large, shared);
  const twobit::Magnitudes m =
      twobit::magnitudes(rms, sum_all, sum_large, n_large, static_cast<float>(len));
  // this chunk's block: [lo byte | codes]; every chunk before it is whole
  uint8_t* block = payload + static_cast<int64_t>(blockIdx.x) * (1 + chunk / 4);
  if (threadIdx.x == 0) {
    block[0] = static_cast<uint8_t>(m.lo_byte);
    scales[blockIdx.x] = m.hi;
  }
  for (int64_t b = threadIdx.x; b * 4 < len; b += kThreads) {
    uint32_t byte = 0;
    for (int k = 0; k < 4 && b * 4 + k < len; ++k) {
      const int64_t i = b * 4 + k;
      const float y = e[i];
      const uint32_t code = twobit::code(y, threshold);
      const float level = code & 2u ? m.hi : m.lo_sent;
      e[i] = __fsub_rn(y, code & 1u ? -level : level);
      byte |= code << (2 * k);
    }
    block[1 + b] = static_cast<uint8_t>(byte);
  }
}

std::tuple<at::Tensor, at::Tensor> twobit_pack_cuda(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  twobit::check_pack(x, error, chunk_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nchunks = (n + chunk_size - 1) / chunk_size;
  auto xc = x.contiguous();
  auto payload = at::empty({twobit::payload_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  if (n == 0) return {payload, scales};
  TORCH_CHECK(nchunks <= 0x7fffffff, "twobit_pack: too many chunks for one launch: ", nchunks);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "twobit_pack", [&] {
    twobit_pack_kernel<scalar_t><<<static_cast<unsigned>(nchunks), kThreads, 0, stream>>>(
        xc.const_data_ptr<scalar_t>(), error.data_ptr<float>(), payload.data_ptr<uint8_t>(),
        scales.data_ptr<float>(), n, chunk_size);
  });
  const cudaError_t status = cudaGetLastError();
  TORCH_CHECK(status == cudaSuccess, "twobit_pack: CUDA error: ", cudaGetErrorString(status));
  return {payload, scales};
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CUDA, m) { m.impl("twobit_pack", &twobit_pack_cuda); }

}  // namespace ciuicflow
