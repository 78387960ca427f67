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
  for (int64_t i = 0; i < chunk; ++i) order[i] = static_cast<int32_t>(i);
  if (finite && k < len) {
    std::nth_element(order, order + k, order + len, [err](int32_t a, int32_t b) {
      const float fa = std::fabs(err[a]), fb = std::fabs(err[b]);
      return fa > fb || (fa == fb && a < b);
    });
  }
  std::sort(order, order + k);
  uint8_t mark[kMaxChunk] = {0};
  for (int64_t i = 0; i < k; ++i) mark[order[i]] = 1;
  const int64_t n_marked = std::min(k, len);  // real ones
  // float sums in position order: a chunk is at most 512 elements
  float sum_all = 0.0f, sum_marked = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(err[i]);
    sum_all += a;
    sum_marked += mark[i] ? a : 0.0f;
  }
  const float hi = n_marked > 0 ? sum_marked / static_cast<float>(n_marked) : 0.0f;
  const float lo = len > k ? (sum_all - sum_marked) / static_cast<float>(len - k) : 0.0f;
  float ratio = hi > 0.0f ? std::rint(lo / hi * 255.0f) : 0.0f;
  ratio = std::min(255.0f, std::max(0.0f, ratio));  // lo <= hi: the marked are the largest
  const float lo_sent = hi * ratio / 255.0f;
  *scale = finite ? hi : NAN;  // a chunk holding inf/NaN says so
  const int64_t sign_bytes = chunk / 8;
  for (int64_t b = 0; b < sign_bytes; ++b) {
    uint32_t byte = 0;
    for (int64_t j = 0; j < 8 && b * 8 + j < len; ++j) {
      const int64_t i = b * 8 + j;
      const float y = err[i];
      const float m = mark[i] ? hi : lo_sent;
      err[i] = y < 0.0f ? y + m : y - m;
      byte |= static_cast<uint32_t>(y < 0.0f) << j;
    }
    block[b] = static_cast<uint8_t>(byte);
  }
  block[sign_bytes] = static_cast<uint8_t>(ratio);
  topmark::write_rank(topmark::rank_of(order, k), block + sign_bytes + 1,
                      topmark::tables().rank_bytes[chunk]);
}

std::tuple<at::Tensor, at::Tensor> topmark_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  topmark::check_chunk(chunk_size, "topmark_pack");
  TORCH_CHECK(x.dim() == 1, "topmark_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              "topmark_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
                  error.numel() == x.numel() && error.device() == x.device(),
              "topmark_pack: error must be a contiguous float32 tensor of ", x.numel(),
              " elements on x's device, got ", error.scalar_type(), " ", error.sizes());
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
  topmark::check_chunk(chunk_size, "topmark_unpack_mean_into");
  const int64_t nchunks = (numel + chunk_size - 1) / chunk_size;
  TORCH_CHECK(payload.dim() == 2 && payload.scalar_type() == at::kByte &&
                  payload.size(1) >= topmark::payload_bytes(numel, chunk_size),
              "topmark_unpack_mean_into: payload must be uint8 [rows, >= ",
              topmark::payload_bytes(numel, chunk_size), "], got ", payload.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == payload.size(0) && scales.size(1) >= nchunks,
              "topmark_unpack_mean_into: scales must be float32 [", payload.size(0), ", >= ",
              nchunks, "], got ", scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= numel,
              "topmark_unpack_mean_into: out must be contiguous float32 of >= ", numel,
              " elements");
  TORCH_CHECK(payload.device().is_cpu() && scales.device().is_cpu() && out.device().is_cpu(),
              "topmark_unpack_mean_into: CPU tensors expected");
  const int64_t rows = payload.size(0);
  auto pc = payload.contiguous();
  auto sc = scales.contiguous();
  const uint8_t* pp = pc.const_data_ptr<uint8_t>();
  const float* sp = sc.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t prow = pc.size(1), srow = sc.size(1), stride = topmark::block_bytes(chunk_size);
  std::atomic<bool> corrupt{false};
  at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size / 4),
                   [&](int64_t c0, int64_t c1) {
    uint8_t mark[kMaxChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size, len = std::min(chunk_size, numel - begin);
      const int64_t k = topmark::marked(chunk_size), sign_bytes = chunk_size / 8;
      float* o = op + begin;
      for (int64_t i = 0; i < len; ++i) o[i] = 0.0f;
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* block = pp + r * prow + c * stride;
        const float hi = sp[r * srow + c];
        const float lo = hi * static_cast<float>(block[sign_bytes]) / 255.0f;
        const topmark::U256 rank =
            topmark::read_rank(block + sign_bytes + 1, topmark::tables().rank_bytes[chunk_size]);
        if (!topmark::marks_of(rank, chunk_size, k, mark)) {
          corrupt = true;
          continue;
        }
        for (int64_t i = 0; i < len; ++i) {
          const float m = mark[i] ? hi : lo;
          o[i] += (block[i / 8] >> (i % 8)) & 1 ? -m : m;
        }
      }
      if (rows > 1)
        for (int64_t i = 0; i < len; ++i) o[i] /= static_cast<float>(rows);
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
