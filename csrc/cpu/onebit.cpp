// CPU kernels of the 1-bit ops. Work is split by chunk: a chunk (a multiple of 8 elements, so whole
// bytes) is read once from memory and its two passes (scale, then signs and error) run from cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>

#include "onebit_common.h"

namespace ciuicflow {
namespace {

constexpr int64_t kGrainElements = 1 << 16;  // below this, threads cost more than they save

// Hot loops are compiled twice, for AVX2 and for baseline x86-64, and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CIUICFLOW_HOT __attribute__((target_clones("avx2", "default")))
#else
#define CIUICFLOW_HOT
#endif

// Eight flags (one 0/1 byte each) -> one byte, flag k in bit k: the multiply gathers each
// byte's low bit into the top byte.
inline uint8_t gather_bits(const uint8_t* flags) {
  uint64_t word;
  std::memcpy(&word, flags, 8);
  return static_cast<uint8_t>((word * 0x0102040810204080ull) >> 56);
}

template <typename scalar_t>
CIUICFLOW_HOT void pack_chunk(const scalar_t* x, float* err, uint8_t* packed, float* scale_out,
                              int64_t len) {
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
  // Pass 2, a block at a time (from cache): flags and error = y - scale * sign, then bytes.
  constexpr int64_t kBlock = 256;
  uint8_t flags[kBlock];
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t n = std::min(kBlock, len - start);
    float* y = err + start;
    for (int64_t k = 0; k < n; ++k) {
      const bool positive = y[k] >= 0.0f;  // false for NaN; true for -0.0
      flags[k] = positive;
      y[k] -= positive ? scale : -scale;
    }
    for (int64_t k = n; k < (n + 7) / 8 * 8; ++k) flags[k] = 0;  // bits past the end are 0
    for (int64_t b = 0; b * 8 < n; ++b) packed[start / 8 + b] = gather_bits(flags + 8 * b);
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

// kSigns.v[byte][k] = +1 if bit k of byte is set, else -1: unpacking a byte is one 8-wide multiply.
struct SignTable {
  float v[256][8];
  SignTable() {
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < 8; ++k) v[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
  }
};
const SignTable kSigns;

// out = scale * signs, or out += scale * signs when accumulate is set.
CIUICFLOW_HOT void unpack_chunk(const uint8_t* packed, float scale, float* out, int64_t len,
                                bool accumulate) {
  const int64_t full = len / 8;
  if (accumulate) {
    for (int64_t b = 0; b < full; ++b) {
      const float* s = kSigns.v[packed[b]];
      for (int k = 0; k < 8; ++k) out[8 * b + k] += s[k] * scale;
    }
  } else {
    for (int64_t b = 0; b < full; ++b) {
      const float* s = kSigns.v[packed[b]];
      for (int k = 0; k < 8; ++k) out[8 * b + k] = s[k] * scale;
    }
  }
  const float* s = kSigns.v[full < (len + 7) / 8 ? packed[full] : 0];
  for (int64_t i = full * 8; i < len; ++i) {
    const float v = s[i - full * 8] * scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

void onebit_unpack_into_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                  int64_t numel, int64_t chunk_size, at::Tensor& out) {
  check_unpack_args("onebit_unpack", packed, scales, numel, chunk_size, 1);
  check_out("onebit_unpack", out, numel, packed);
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
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
}

CIUICFLOW_HOT void scale_chunk(float* out, int64_t len, float factor) {
  for (int64_t i = 0; i < len; ++i) out[i] *= factor;
}

void onebit_unpack_mean_into_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                       int64_t numel, int64_t chunk_size, at::Tensor& out) {
  check_unpack_args("onebit_unpack_mean", packed, scales, numel, chunk_size, 2);
  check_out("onebit_unpack_mean", out, numel, packed);
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  const int64_t world = pc.size(0), nbytes = pc.size(1), nchunks = sc.size(1);
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
      scale_chunk(o + begin, len, inv_world);
    }
  });
}

at::Tensor onebit_unpack_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                             int64_t chunk_size) {
  auto out = at::empty({numel}, scales.options().dtype(at::kFloat));
  onebit_unpack_into_cpu(packed, scales, numel, chunk_size, out);
  return out;
}

at::Tensor onebit_unpack_mean_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                  int64_t numel, int64_t chunk_size) {
  auto out = at::empty({numel}, scales.options().dtype(at::kFloat));
  onebit_unpack_mean_into_cpu(packed, scales, numel, chunk_size, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("onebit_pack", &onebit_pack_cpu);
  m.impl("onebit_unpack", &onebit_unpack_cpu);
  m.impl("onebit_unpack_into", &onebit_unpack_into_cpu);
  m.impl("onebit_unpack_mean", &onebit_unpack_mean_cpu);
  m.impl("onebit_unpack_mean_into", &onebit_unpack_mean_into_cpu);
}

}  // namespace ciuicflow
