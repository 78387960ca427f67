// The topmark codec (ciuicflow/compression/topmark.py has the format and why): every element's
// sign, the largest 55/512 of each chunk marked, two fitted magnitudes; CPU pack and unpack.
// topmark_common.h: the sizes and the rank of the marked positions.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>

#include "../topmark_common.h"
#include "cpu_common.h"

namespace ciuicflow {
namespace {

using topmark::kMaxChunk;

// len real elements of a chunk of `chunk` (len < chunk: a trimmed last chunk)
template <typename scalar_t>
void pack_chunk(const scalar_t* x, float* err, uint8_t* block, float* scale, int64_t len,
                int64_t chunk) {
  const int64_t k = topmark::marked(chunk);
  bool finite = true;
  for (int64_t i = 0; i < len; ++i) {
    const float y = static_cast<float>(x[i]) + err[i];
    err[i] = y;
    finite = finite && std::isfinite(y);
  }
  // the k largest |y| (ties to the lower position); positions ascending for the rank. Where
  // fewer than k are real, the missing ones after them fill the marks (never read).
  int32_t order[kMaxChunk];
  if (finite && k < len) {
    uint64_t keys[kMaxChunk];
    for (int64_t i = 0; i < len; ++i) keys[i] = topmark::key_of(err[i], static_cast<int32_t>(i));
    std::nth_element(keys, keys + k, keys + len, std::greater<uint64_t>());
    for (int64_t i = 0; i < k; ++i) order[i] = topmark::position_of(keys[i]);
  } else {
    for (int64_t i = 0; i < k; ++i) order[i] = static_cast<int32_t>(i);
  }
  std::sort(order, order + k);
  uint8_t mark[kMaxChunk];
  topmark::send_marked(err, order, mark, len, chunk, finite, block, scale, topmark::binomials(),
                       topmark::tables().rank_bytes[chunk]);
}

std::tuple<at::Tensor, at::Tensor> topmark_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  topmark::check_pack(x, error, chunk_size);
  const int64_t n = x.numel(), nchunks = (n + chunk_size - 1) / chunk_size;
  auto xc = x.contiguous();
  auto payload = at::empty({topmark::payload_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  float* err = error.data_ptr<float>();
  uint8_t* pp = payload.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t stride = topmark::block_bytes(chunk_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "topmark_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size / 4),
                     [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * chunk_size, len = std::min(chunk_size, n - begin);
        pack_chunk(xp + begin, err + begin, pp + c * stride, sp + c, len, chunk_size);
      }
    });
  });
  return {payload, scales};
}

// out = the mean of the rows (one row: its values), summed in row order per element.
void topmark_unpack_mean_into_cpu(const at::Tensor& payload, const at::Tensor& scales,
                                  int64_t numel, int64_t chunk_size, at::Tensor& out) {
  topmark::check_unpack(payload, scales, numel, chunk_size, out);
  const int64_t nchunks = (numel + chunk_size - 1) / chunk_size;
  const int64_t rows = payload.size(0);
  auto pc = payload.contiguous();
  auto sc = scales.contiguous();
  const uint8_t* pp = pc.const_data_ptr<uint8_t>();
  const float* sp = sc.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t prow = pc.size(1), srow = sc.size(1);
  std::atomic<bool> corrupt{false};
  at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size / 4),
                   [&](int64_t c0, int64_t c1) {
    uint8_t mark[kMaxChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size, len = std::min(chunk_size, numel - begin);
      if (!topmark::unpack_chunk_mean(pp, prow, sp, srow, rows, c, len, chunk_size, op + begin,
                                      mark, topmark::binomials(),
                                      topmark::tables().rank_bytes[chunk_size]))
        corrupt = true;
    }
  });
  TORCH_CHECK(!corrupt, "topmark_unpack_mean_into: a chunk's rank is not a set of ",
              "marked positions (corrupt payload)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // error is updated in place; returns (payload uint8, per chunk [signs | lo byte | rank],
  // scales float32)
  m.def("topmark_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
  m.def("topmark_unpack_mean_into(Tensor payload, Tensor scales, int numel, int chunk_size, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("topmark_pack", &topmark_pack_cpu);
  m.impl("topmark_unpack_mean_into", &topmark_unpack_mean_into_cpu);
}

}  // namespace ciuicflow
