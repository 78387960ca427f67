// CPU kernels of the 1-bit ops. Work is split by chunk: a chunk (a multiple of 8 elements, so whole
// bytes) is read once from memory and its two passes (scale, then signs and error) run from cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "onebit_common.h"

namespace ciuicflow {
namespace {

constexpr int64_t kGrainElements = 1 << 16;  // below this, threads cost more than they save

template <typename scalar_t>
void pack_chunk(const scalar_t* x, float* err, uint8_t* packed, float* scale_out, int64_t len) {
  // Pass 1: y = x + error (kept in err), sum |y| in 8 lanes so the loop vectorises.
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t body = len - len % 8;
  for (int64_t i = 0; i < body; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const float y = static_cast<float>(x[i + k]) + err[i + k];
      err[i + k] = y;
      lanes[k] += std::fabs(y);
    }
  }
  double sum = 0;
  for (int k = 0; k < 8; ++k) sum += lanes[k];
  for (int64_t i = body; i < len; ++i) {
    const float y = static_cast<float>(x[i]) + err[i];
    err[i] = y;
    sum += std::fabs(y);
  }
  const float scale = static_cast<float>(sum / static_cast<double>(len));
  *scale_out = scale;
  // Pass 2: sign bits (LSB first) and error = y - scale * sign.
  for (int64_t b = 0; b * 8 < len; ++b) {
    const int64_t n = std::min<int64_t>(8, len - b * 8);
    float* y = err + b * 8;
    uint8_t byte = 0;
    for (int64_t k = 0; k < n; ++k) {
      const bool positive = y[k] >= 0.0f;
      byte |= static_cast<uint8_t>(positive) << k;
      y[k] -= positive ? scale : -scale;
    }
    packed[b] = byte;
  }
}

std::tuple<at::Tensor, at::Tensor> onebit_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  check_pack_args(x, error, chunk_size);
  const int64_t n = x.numel();
  auto xc = x.contiguous();
  auto packed = at::empty({ceil_div(n, 8)}, x.options().dtype(at::kByte));
  auto scales = at::empty({ceil_div(n, chunk_size)}, x.options().dtype(at::kFloat));
  if (n == 0) return {packed, scales};
  float* err = error.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "onebit_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
    at::parallel_for(0, scales.numel(), grain, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * chunk_size;
        const int64_t len = std::min(chunk_size, n - begin);
        pack_chunk(xp + begin, err + begin, out + begin / 8, sc + c, len);
      }
    });
  });
  return {packed, scales};
}

// out[i] = weight * scale * (bit ? 1 : -1), added to out when accumulate is set.
inline void unpack_chunk(const uint8_t* packed, float scale, float* out, int64_t len,
                         bool accumulate) {
  for (int64_t b = 0; b * 8 < len; ++b) {
    const int64_t n = std::min<int64_t>(8, len - b * 8);
    const uint8_t byte = packed[b];
    float* o = out + b * 8;
    for (int64_t k = 0; k < n; ++k) {
      const float v = ((byte >> k) & 1) ? scale : -scale;
      o[k] = accumulate ? o[k] + v : v;
    }
  }
}

at::Tensor onebit_unpack_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                             int64_t chunk_size) {
  check_unpack_args("onebit_unpack", packed, scales, numel, chunk_size, 1);
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  auto out = at::empty({numel}, sc.options());
  const uint8_t* p = pc.const_data_ptr<uint8_t>();
  const float* s = sc.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
  at::parallel_for(0, sc.numel(), grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size;
      unpack_chunk(p + begin / 8, s[c], o + begin, std::min(chunk_size, numel - begin), false);
    }
  });
  return out;
}

at::Tensor onebit_unpack_mean_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                  int64_t numel, int64_t chunk_size) {
  check_unpack_args("onebit_unpack_mean", packed, scales, numel, chunk_size, 2);
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  const int64_t world = pc.size(0), nbytes = pc.size(1), nchunks = sc.size(1);
  auto out = at::empty({numel}, sc.options());
  const uint8_t* p = pc.const_data_ptr<uint8_t>();
  const float* s = sc.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float inv_world = 1.0f / static_cast<float>(world);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size;
      const int64_t len = std::min(chunk_size, numel - begin);
      // Sum the W vectors in rank order (so every rank gets the same bits), then scale once.
      for (int64_t w = 0; w < world; ++w) {
        unpack_chunk(p + w * nbytes + begin / 8, s[w * nchunks + c], o + begin, len, w > 0);
      }
      for (int64_t i = begin; i < begin + len; ++i) o[i] *= inv_world;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("onebit_pack", &onebit_pack_cpu);
  m.impl("onebit_unpack", &onebit_unpack_cpu);
  m.impl("onebit_unpack_mean", &onebit_unpack_mean_cpu);
}

}  // namespace ciuicflow
