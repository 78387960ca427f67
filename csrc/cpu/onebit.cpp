// CPU kernels of the 1-bit ops. Work is split by chunk: a chunk (a multiple of 8 elements, so whole
// bytes) is read once from memory and its two passes (scale, then signs and error) run from cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "onebit_common.h"

namespace ciuicflow {
namespace {

// Eight flags (one 0/1 byte each) -> one byte, flag k in bit k: the multiply gathers each
// byte's low bit into the top byte.
inline uint8_t gather_bits(const uint8_t* flags) {
  uint64_t word;
  std::memcpy(&word, flags, 8);
  return static_cast<uint8_t>((word * 0x0102040810204080ull) >> 56);
}

// Running sums of one pack: sum |y| and sum y^2 of the current chunk (its scale, and the new
// error's norm: sum (y - scale * sign y)^2 = sum y^2 - len * scale^2 as scale = mean |y|, which
// keeps the second pass as lean as it was), and over the whole tensor sum x^2 and sum new_error^2,
// for the accuracy guard.
struct PackSums {
  double abs = 0, y2 = 0, x2 = 0, e2 = 0;
};

// add_error's elements past the last whole group of 8, one at a time (shared by both versions).
template <typename scalar_t>
inline void add_error_tail(const scalar_t* x, const float* err_in, float decay, float* err_out,
                           int64_t begin, int64_t len, PackSums& sums) {
  for (int64_t i = begin; i < len; ++i) {
    const float v = static_cast<float>(x[i]);
    const float y = v + decay * err_in[i];
    err_out[i] = y;
    sums.abs += std::fabs(y);
    sums.y2 += y * y;
    sums.x2 += v * v;
  }
}

// y = x + decay * err_in (kept in err_out; the two may be one buffer) over len elements; adds |y|,
// y^2 and x^2 to sums, in 8 lanes so the loop vectorises. decay * e is rounded before the add (as a
// separate multiply would be): with decay 1 it is exactly x + e.
//
// The 8 lanes are a GCC vector (one AVX register, two SSE ones in the baseline build): plain
// arrays of three sums made the vectoriser shuffle every element, at a third of the speed.
// kInPlace: err_in is err_out (read through err_out only); otherwise the two are distinct.

template <bool kInPlace, typename scalar_t>
CIUICFLOW_HOT void add_error(const scalar_t* __restrict__ x, const float* __restrict__ err_in,
                             float decay, float* __restrict__ err_out, int64_t len,
                             PackSums& sums) {
  const float* src = kInPlace ? err_out : err_in;
  Lanes abs_sum = {}, y_squares = {}, x_squares = {};
  const int64_t body = len - len % 8;
  for (int64_t i = 0; i < body; i += 8) {
    Lanes v, e;
    load_lanes(x + i, v);
    std::memcpy(&e, src + i, sizeof e);
    const Lanes y = v + decay * e;
    std::memcpy(err_out + i, &y, sizeof y);
    abs_sum += reinterpret_cast<Lanes>(reinterpret_cast<IntLanes>(y) & 0x7fffffff);
    y_squares += y * y;
    x_squares += v * v;
  }
  for (int k = 0; k < 8; ++k) {
    sums.abs += abs_sum[k], sums.y2 += y_squares[k], sums.x2 += x_squares[k];
  }
  add_error_tail(x, src, decay, err_out, body, len, sums);
}

#if defined(__x86_64__) && defined(__GNUC__)
// add_error for IEEE half input with the F16C conversion instruction: the generic conversion is bit
// twiddling the compiler cannot vectorise. Same 8-lane arithmetic as the generic loop.
__attribute__((target("avx,f16c"))) void add_error_f16c(const at::Half* x, const float* err_in,
                                                         float decay, float* err_out, int64_t len,
                                                         PackSums& sums) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 d = _mm256_set1_ps(decay);
  __m256 lanes = _mm256_setzero_ps(), y_squares = _mm256_setzero_ps();
  __m256 x_squares = _mm256_setzero_ps();
  const int64_t body = len - len % 8;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256 y = _mm256_add_ps(v, _mm256_mul_ps(d, _mm256_loadu_ps(err_in + i)));
    _mm256_storeu_ps(err_out + i, y);
    lanes = _mm256_add_ps(lanes, _mm256_and_ps(y, abs_mask));
    y_squares = _mm256_add_ps(y_squares, _mm256_mul_ps(y, y));
    x_squares = _mm256_add_ps(x_squares, _mm256_mul_ps(v, v));
  }
  float lane[8], y_square[8], x_square[8];
  _mm256_storeu_ps(lane, lanes);
  _mm256_storeu_ps(y_square, y_squares);
  _mm256_storeu_ps(x_square, x_squares);
  for (int k = 0; k < 8; ++k) sums.abs += lane[k], sums.y2 += y_square[k], sums.x2 += x_square[k];
  add_error_tail(x, err_in, decay, err_out, body, len, sums);
}
// Initialised while the library loads, so the CPU model must be set up explicitly first.
const bool kHasF16C = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c") != 0;
}();
#endif

template <bool kInPlace, typename scalar_t>
void add_error_dispatch(const scalar_t* x, const float* err_in, float decay, float* err_out,
                        int64_t len, PackSums& sums) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, at::Half>) {
    if (kHasF16C) return add_error_f16c(x, err_in, decay, err_out, len, sums);
  }
#endif
  add_error<kInPlace>(x, err_in, decay, err_out, len, sums);
}

template <bool kInPlace, typename scalar_t>
CIUICFLOW_HOT void pack_chunk(const scalar_t* x, const float* err_in, float decay, float* err,
                              uint8_t* packed, float* scale_out, int64_t len, PackSums& sums) {
  // Pass 1: y = x + decay * error (kept in err), sum |y| and sum y^2.
  sums.abs = sums.y2 = 0;
  add_error_dispatch<kInPlace>(x, err_in, decay, err, len, sums);
  const float scale = static_cast<float>(sums.abs / static_cast<double>(len));
  *scale_out = scale;
  // Rounding may leave the difference a hair below zero where every |y| is equal.
  sums.e2 += std::max(0.0, sums.y2 - static_cast<double>(len) * scale * scale);
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

// The shared body of onebit_pack and onebit_pack_ef: returns (packed, scales), fills totals with
// (sum new_error^2, sum x^2) in float64.
std::tuple<at::Tensor, at::Tensor> pack_into(const at::Tensor& x, const float* err_in, double decay,
                                             at::Tensor& error_out, int64_t chunk_size,
                                             double totals[2]) {
  const int64_t n = x.numel();
  auto xc = x.contiguous();
  auto packed = at::empty({ceil_div(n, 8)}, x.options().dtype(at::kByte));
  auto scales = at::empty({ceil_div(n, chunk_size)}, x.options().dtype(at::kFloat));
  totals[0] = totals[1] = 0;
  if (n == 0) return {packed, scales};
  float* err = error_out.data_ptr<float>();
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float d = static_cast<float>(decay);
  const bool in_place = err_in == err;  // one tensor (the checks refuse a partial overlap)
  using Pair = std::pair<double, double>;
  Pair total;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "onebit_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
    total = at::parallel_reduce(
        0, scales.numel(), grain, Pair(0, 0),
        [&](int64_t c0, int64_t c1, Pair acc) {
          PackSums sums;
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t begin = c * chunk_size;
            const int64_t len = std::min(chunk_size, n - begin);
            if (in_place) {
              pack_chunk<true>(xp + begin, err + begin, d, err + begin, out + begin / 8, sc + c,
                               len, sums);
            } else {
              pack_chunk<false>(xp + begin, err_in + begin, d, err + begin, out + begin / 8,
                                sc + c, len, sums);
            }
          }
          return Pair(acc.first + sums.e2, acc.second + sums.x2);
        },
        [](Pair a, Pair b) { return Pair(a.first + b.first, a.second + b.second); });
  });
  totals[0] = total.first;
  totals[1] = total.second;
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor> onebit_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                    int64_t chunk_size) {
  check_pack_args(x, error, chunk_size);
  double totals[2];
  return pack_into(x, error.data_ptr<float>(), 1.0, error, chunk_size, totals);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_pack_ef_cpu(const at::Tensor& x,
                                                                  const at::Tensor& error,
                                                                  double error_decay,
                                                                  at::Tensor& error_out,
                                                                  int64_t chunk_size) {
  check_pack_ef_args(x, error, error_out, chunk_size);
  double totals[2];
  auto [packed, scales] = pack_into(x, error.const_data_ptr<float>(), error_decay, error_out,
                                    chunk_size, totals);
  return {packed, scales, at::tensor({totals[0], totals[1]}, x.options().dtype(at::kDouble))};
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

// Outputs at least this large do not fit in cache anyway; streaming stores skip the read-for-ownership
// that a normal store of a cold line costs, so the write moves each byte once instead of twice.
constexpr int64_t kStreamBytes = 8 << 20;

#if defined(__x86_64__)
// out = scale * signs with non-temporal stores. len is a multiple of 8 and out is 16-byte aligned.
void unpack_chunk_stream(const uint8_t* packed, float scale, float* out, int64_t len) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t b = 0; b < len / 8; ++b) {
    const float* s = kSigns.v[packed[b]];
    _mm_stream_ps(out + 8 * b, _mm_mul_ps(_mm_loadu_ps(s), sc));
    _mm_stream_ps(out + 8 * b + 4, _mm_mul_ps(_mm_loadu_ps(s + 4), sc));
  }
}
#endif

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
#if defined(__x86_64__)
  const bool stream = numel * 4 >= kStreamBytes && reinterpret_cast<std::uintptr_t>(o) % 16 == 0;
#else
  const bool stream = false;
#endif
  at::parallel_for(0, sc.numel(), grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size;
      const int64_t len = std::min(chunk_size, numel - begin);
#if defined(__x86_64__)
      if (stream) {  // chunk_size is a multiple of 8, so each chunk starts 32-byte aligned
        const int64_t body = len - len % 8;
        unpack_chunk_stream(p + begin / 8, s[c], o + begin, body);
        if (body < len) unpack_chunk(p + (begin + body) / 8, s[c], o + begin + body, len - body, false);
        continue;
      }
#endif
      unpack_chunk(p + begin / 8, s[c], o + begin, len, false);
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();  // make the streamed stores visible before this thread's part ends
#endif
  });
}

CIUICFLOW_HOT void scale_chunk(float* out, int64_t len, float factor) {
  for (int64_t i = 0; i < len; ++i) out[i] *= factor;
}

#if defined(__x86_64__)
// out = inv_world * (sum over w of scale_w * signs_w) for len (a multiple of 8) elements, the
// sum in rank order (as the generic loop), kept in registers: one store per element, streamed
// when `stream` (out 16-byte aligned) instead of a cold store and W-1 read-modify-writes.
void unpack_mean_sse(const uint8_t* packed, int64_t row_bytes, const float* scales,
                     int64_t row_scales, int64_t world, float inv_world, float* out, int64_t len,
                     bool stream) {
  const __m128 inv = _mm_set1_ps(inv_world);
  for (int64_t b = 0; b < len / 8; ++b) {
    __m128 lo = _mm_setzero_ps(), hi = _mm_setzero_ps();
    for (int64_t w = 0; w < world; ++w) {
      const float* s = kSigns.v[packed[w * row_bytes + b]];
      const __m128 sc = _mm_set1_ps(scales[w * row_scales]);
      const __m128 vlo = _mm_mul_ps(_mm_loadu_ps(s), sc), vhi = _mm_mul_ps(_mm_loadu_ps(s + 4), sc);
      lo = w ? _mm_add_ps(lo, vlo) : vlo;
      hi = w ? _mm_add_ps(hi, vhi) : vhi;
    }
    lo = _mm_mul_ps(lo, inv);
    hi = _mm_mul_ps(hi, inv);
    if (stream) {
      _mm_stream_ps(out + 8 * b, lo);
      _mm_stream_ps(out + 8 * b + 4, hi);
    } else {
      _mm_storeu_ps(out + 8 * b, lo);
      _mm_storeu_ps(out + 8 * b + 4, hi);
    }
  }
}
#endif

// packed is [W, ceil(n/8)] (rows may lie apart: only the last stride must be 1), or [W, nchunks,
// B] with B >= chunk_size / 8: each chunk's signs at the start of a block of B bytes, as the outlier
// codec lays its payload out (compression/outliers.py), read where they lie instead of gathered.
void onebit_unpack_mean_into_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                       int64_t numel, int64_t chunk_size, at::Tensor& out) {
  const char* op = "onebit_unpack_mean";
  at::Tensor pc;
  int64_t row_stride, chunk_stride;
  if (packed.dim() == 3) {
    check_chunk_size(chunk_size);
    TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
    TORCH_CHECK(packed.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat &&
                    scales.dim() == 2, op, ": blocks must be uint8 and scales 2-D float32");
    TORCH_CHECK(packed.size(0) == scales.size(0) && packed.size(0) > 0, op, ": blocks have ",
                packed.size(0), " vectors, scales ", scales.size(0));
    TORCH_CHECK(packed.size(1) == ceil_div(numel, chunk_size) &&
                    scales.size(1) == packed.size(1), op, ": numel ", numel, " with chunk_size ",
                chunk_size, " needs ", ceil_div(numel, chunk_size), " blocks and scales, got ",
                packed.size(1), " and ", scales.size(1));
    TORCH_CHECK(packed.size(2) >= chunk_size / 8, op, ": blocks of ", packed.size(2),
                " bytes cannot hold ", chunk_size / 8, " bytes of signs");
    TORCH_CHECK(packed.device() == scales.device(), op, ": packed is on ", packed.device(),
                ", scales on ", scales.device());
    pc = packed.stride(2) == 1 ? packed : packed.contiguous();
    row_stride = pc.stride(0);
    chunk_stride = pc.stride(1);
  } else {
    check_unpack_args(op, packed, scales, numel, chunk_size, 2);
    pc = packed.stride(1) == 1 ? packed : packed.contiguous();
    row_stride = pc.stride(0);
    chunk_stride = chunk_size / 8;
  }
  check_out(op, out, numel, packed);
  auto sc = scales.contiguous();
  const int64_t world = pc.size(0), nchunks = sc.size(1);
  const uint8_t* p = pc.const_data_ptr<uint8_t>();
  const float* s = sc.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float inv_world = 1.0f / static_cast<float>(world);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
#if defined(__x86_64__)
  const bool stream = numel * 4 >= kStreamBytes && reinterpret_cast<std::uintptr_t>(o) % 16 == 0;
#endif
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size;
      const int64_t len = std::min(chunk_size, numel - begin);
      const uint8_t* signs = p + c * chunk_stride;
      int64_t done = 0;
#if defined(__x86_64__)
      done = len - len % 8;  // chunk_size is a multiple of 8: each chunk starts 32-byte aligned
      unpack_mean_sse(signs, row_stride, s + c, nchunks, world, inv_world, o + begin, done,
                      stream);
#endif
      if (done < len) {  // the generic loop: sum the W vectors in rank order, then scale once
        for (int64_t w = 0; w < world; ++w) {
          unpack_chunk(signs + w * row_stride + done / 8, s[w * nchunks + c], o + begin + done,
                       len - done, w > 0);
        }
        scale_chunk(o + begin + done, len - done, inv_world);
      }
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();  // make the streamed stores visible before this thread's part ends
#endif
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
  m.impl("onebit_pack_ef", &onebit_pack_ef_cpu);
  m.impl("onebit_unpack", &onebit_unpack_cpu);
  m.impl("onebit_unpack_into", &onebit_unpack_into_cpu);
  m.impl("onebit_unpack_mean", &onebit_unpack_mean_cpu);
  m.impl("onebit_unpack_mean_into", &onebit_unpack_mean_into_cpu);
}

}  // namespace ciuicflow
