// CUDA kernels and registration of the topmark codec (ciuicflow/compression/topmark.py has the
// format): one thread per chunk, as the CPU kernel's loop body, so both send the same bits for the
// same input: the selection here is a quickselect over (|y|, position) keys, which picks the same
// set as the CPU's nth_element (the keys are distinct), and everything after it is
// topmark_common.h's send_marked / unpack_chunk_mean. The table of binomials is copied to each
// device once. A first version: a chunk's 512 keys live in the thread's local memory.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <mutex>

#include "../topmark_common.h"
#include "to_float.cuh"

namespace ciuicflow {
namespace {

using topmark::kMaxChunk;
using topmark::U256;

constexpr int kThreads = 64;

// The binomials on ``device`` (a copy of the host table, made once per device).
const U256* device_binomials(const at::Device& device) {
  static std::mutex lock;
  static std::map<int, at::Tensor> copies;
  std::lock_guard<std::mutex> guard(lock);
  auto it = copies.find(device.index());
  if (it == copies.end()) {
    const int64_t words = (kMaxChunk + 1) * topmark::kStride * 4;
    auto host = at::from_blob(const_cast<U256*>(topmark::binomials()), {words},
                              at::TensorOptions().dtype(at::kLong));
    it = copies.emplace(device.index(), host.to(device)).first;
  }
  return reinterpret_cast<const U256*>(it->second.const_data_ptr<int64_t>());
}

// Moves the k largest of keys[0, len) to keys[0, k) (Hoare-style quickselect, middle pivot).
__device__ void select_largest(uint64_t* keys, int64_t len, int64_t k) {
  int64_t lo = 0, hi = len - 1;
  while (lo < hi) {
    const uint64_t pivot = keys[lo + (hi - lo) / 2];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (keys[i] > pivot) ++i;
      while (keys[j] < pivot) --j;
      if (i <= j) {
        const uint64_t t = keys[i];
        keys[i] = keys[j];
        keys[j] = t;
        ++i;
        --j;
      }
    }
    if (k - 1 <= j) hi = j;
    else if (k - 1 >= i) lo = i;
    else break;
  }
}

template <typename scalar_t>
__global__ void topmark_pack_kernel(const scalar_t* __restrict__ x, float* __restrict__ err,
                                    uint8_t* __restrict__ payload, float* __restrict__ scales,
                                    int64_t n, int64_t chunk, int64_t nchunks, int64_t rank_bytes,
                                    const U256* __restrict__ binom) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= nchunks) return;
  const int64_t begin = c * chunk, len = begin + chunk < n ? chunk : n - begin;
  const int64_t k = topmark::marked(chunk);
  float* e = err + begin;
  bool finite = true;
  for (int64_t i = 0; i < len; ++i) {
    const float y = __fadd_rn(to_float(x[begin + i]), e[i]);
    e[i] = y;
    finite = finite && isfinite(y);
  }
  uint64_t keys[kMaxChunk];
  int32_t marked_at[kMaxChunk];
  if (finite && k < len) {
    for (int64_t i = 0; i < len; ++i) keys[i] = topmark::key_of(e[i], static_cast<int32_t>(i));
    select_largest(keys, len, k);
    for (int64_t i = 0; i < k; ++i) marked_at[i] = topmark::position_of(keys[i]);
    for (int64_t i = 1; i < k; ++i) {  // ascending (insertion sort: k is at most 55)
      const int32_t v = marked_at[i];
      int64_t j = i - 1;
      for (; j >= 0 && marked_at[j] > v; --j) marked_at[j + 1] = marked_at[j];
      marked_at[j + 1] = v;
    }
  } else {  // every real element marked, then the missing ones (or, not finite, the first k)
    for (int64_t i = 0; i < k; ++i) marked_at[i] = static_cast<int32_t>(i);
  }
  uint8_t mark[kMaxChunk];
  topmark::send_marked(e, marked_at, mark, len, chunk, finite,
                       payload + c * (chunk / 8 + 1 + rank_bytes), scales + c, binom, rank_bytes);
}

__global__ void topmark_unpack_mean_kernel(const uint8_t* __restrict__ payload, int64_t prow,
                                           const float* __restrict__ scales, int64_t srow,
                                           int64_t rows, int64_t numel, int64_t chunk,
                                           int64_t nchunks, int64_t rank_bytes,
                                           const U256* __restrict__ binom, float* __restrict__ out,
                                           int* __restrict__ corrupt) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= nchunks) return;
  const int64_t begin = c * chunk, len = begin + chunk < numel ? chunk : numel - begin;
  uint8_t mark[kMaxChunk];
  if (!topmark::unpack_chunk_mean(payload, prow, scales, srow, rows, c, len, chunk, out + begin,
                                  mark, binom, rank_bytes))
    atomicExch(corrupt, 1);
}

std::tuple<at::Tensor, at::Tensor> topmark_pack_cuda(const at::Tensor& x, at::Tensor& error,
                                                     int64_t chunk_size) {
  topmark::check_pack(x, error, chunk_size);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nchunks = (n + chunk_size - 1) / chunk_size;
  auto xc = x.contiguous();
  auto payload = at::zeros({topmark::payload_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  if (nchunks == 0) return {payload, scales};
  const U256* binom = device_binomials(x.device());
  const int64_t rank_bytes = topmark::tables().rank_bytes[chunk_size];
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>((nchunks + kThreads - 1) / kThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "topmark_pack_cuda", [&] {
    topmark_pack_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        xc.const_data_ptr<scalar_t>(), error.data_ptr<float>(), payload.data_ptr<uint8_t>(),
        scales.data_ptr<float>(), n, chunk_size, nchunks, rank_bytes, binom);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {payload, scales};
}

void topmark_unpack_mean_into_cuda(const at::Tensor& payload, const at::Tensor& scales,
                                   int64_t numel, int64_t chunk_size, at::Tensor& out) {
  topmark::check_unpack(payload, scales, numel, chunk_size, out);
  const int64_t nchunks = (numel + chunk_size - 1) / chunk_size;
  if (nchunks == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  auto pc = payload.contiguous();
  auto sc = scales.contiguous();
  auto corrupt = at::zeros({1}, out.options().dtype(at::kInt));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = static_cast<unsigned>((nchunks + kThreads - 1) / kThreads);
  topmark_unpack_mean_kernel<<<blocks, kThreads, 0, stream>>>(
      pc.const_data_ptr<uint8_t>(), pc.size(1), sc.const_data_ptr<float>(), sc.size(1),
      pc.size(0), numel, chunk_size, nchunks, topmark::tables().rank_bytes[chunk_size],
      device_binomials(out.device()), out.data_ptr<float>(), corrupt.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCH_CHECK(corrupt.item<int>() == 0, "topmark_unpack_mean_into: a chunk's rank is not a set ",
              "of marked positions (corrupt payload)");
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CUDA, m) {
  m.impl("topmark_pack", &topmark_pack_cuda);
  m.impl("topmark_unpack_mean_into", &topmark_unpack_mean_into_cuda);
}

}  // namespace ciuicflow
