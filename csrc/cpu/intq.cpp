// Integer quantisation with error feedback (int8, int4): schemas and CPU kernels. One scale
// (max |y| / levels) per chunk; work is split by chunk, each chunk's two passes (scale, then values
// and error) from cache. A chunk holds whole bytes of payload, so chunks never share a byte.
// The hot loops run 8 floats at a time (GCC vectors, AVX2 intrinsics where the compiler will not
// vectorise), each element through intq_common.h's operations in the scalar loops' order, NaNs
// included: the same bits as those loops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "intq_common.h"

namespace ciuicflow {
namespace {

// Elements per block of a chunk's second pass (and of an unpack), its values staged in a small
// buffer that stays in L1.
constexpr int64_t kBlock = 256;


// Pass 1 of a chunk: y = xu + d into err_out (which may be err_in), where, in the optimizer's
// units u (kUnits; else 1), xu = x / u and d = decay * (err_in / u) (kScaled; else err_in / u
// itself): each step rounded as the torch ops that define intq_pack_ef round it (a division, a
// multiply, an add; intq_pack is the case y = x + err). Returns max |y| over the elements that are
// not NaN and sets *nan where one is; with kSquares adds sum xu^2 to *x2. The maximum does not
// depend on the order it is taken in (every |y| is >= +0, NaN never wins a comparison), so 8
// lanes give the scalar loop's value.
template <bool kScaled, bool kUnits, bool kSquares, typename scalar_t>
CIUICFLOW_HOT float ef_add_error_amax(const scalar_t* __restrict__ x, const float* err_in,
                                      float decay, const float* __restrict__ u, float* err_out,
                                      int64_t len, bool* nan, double* x2) {
  Lanes lanes_max = {}, lanes_x2 = {};
  IntLanes lanes_nan = {};
  const int64_t body = len - len % 8;
  for (int64_t i = 0; i < body; i += 8) {
    Lanes v, e;
    load_lanes(x + i, v);
    std::memcpy(&e, err_in + i, sizeof e);
    if constexpr (kUnits) {
      Lanes w;
      std::memcpy(&w, u + i, sizeof w);
      v = v / w;
      e = e / w;
    }
    if constexpr (kScaled) e = decay * e;
    // where both are NaN the scalar x + err gives x's (quieted): the compiler may swap the
    // operands of a vector add, so that choice is made here
    const Lanes y = v != v ? v + v : v + e;
    std::memcpy(err_out + i, &y, sizeof y);
    const Lanes a = reinterpret_cast<Lanes>(reinterpret_cast<IntLanes>(y) & 0x7fffffff);
    lanes_nan |= a != a;
    lanes_max = a > lanes_max ? a : lanes_max;
    if constexpr (kSquares) lanes_x2 += v * v;
  }
  float amax = 0.0f;
  bool any_nan = false;
  double squares = 0.0;
  for (int k = 0; k < 8; ++k) {
    amax = lanes_max[k] > amax ? lanes_max[k] : amax;
    any_nan |= lanes_nan[k] != 0;
    squares += lanes_x2[k];
  }
  for (int64_t i = body; i < len; ++i) {
    float v = static_cast<float>(x[i]);
    float e = err_in[i];
    if constexpr (kUnits) {
      v = v / u[i];
      e = e / u[i];
    }
    if constexpr (kScaled) e = decay * e;
    const float y = v != v ? v + v : v + e;
    err_out[i] = y;
    const float a = std::fabs(y);
    any_nan |= a != a;
    amax = a > amax ? a : amax;
    if constexpr (kSquares) squares += static_cast<double>(v) * v;
  }
  *nan = any_nan;
  if constexpr (kSquares) *x2 += squares;
  return amax;
}

// Pass 2 of a block with a usable scale (> 0 and finite): q = the quantised values, and
// err -= q * s, with intq::quantize's arithmetic on every element.
template <typename F>
inline void quantize_scalar(float* err, int8_t* q, float s, int64_t begin, int64_t n) {
  for (int64_t k = begin; k < n; ++k) {
    const int v = intq::quantize<F>(err[k], s);
    q[k] = static_cast<int8_t>(v);
    err[k] = err[k] - static_cast<float>(v) * s;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// quantize_scalar 8 elements at a time, for the first n - n % 8; returns how many it did. The
// compiler does not vectorise the scalar loop (its clamp is control flow it must not speculate
// under trapping math), so the same operations are spelt out: divide, round in the current mode
// (rintf), clamp, through int (a -0.0 rounding leaves +0.0, as quantize's int does), multiply back.
template <typename F>
__attribute__((target("avx2"))) int64_t quantize_avx2(float* err, int8_t* q, float s, int64_t n) {
  const __m256 scale = _mm256_set1_ps(s);
  const __m256 top = _mm256_set1_ps(F::kLevels), bottom = _mm256_set1_ps(-F::kLevels);
  const int64_t body = n - n % 8;
  for (int64_t k = 0; k < body; k += 8) {
    const __m256 e = _mm256_loadu_ps(err + k);
    __m256 r = _mm256_round_ps(_mm256_div_ps(e, scale), _MM_FROUND_CUR_DIRECTION);
    r = _mm256_blendv_ps(r, top, _mm256_cmp_ps(r, top, _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, bottom, _mm256_cmp_ps(r, bottom, _CMP_LT_OQ));
    const __m256i v = _mm256_cvttps_epi32(r);
    _mm256_storeu_ps(err + k, _mm256_sub_ps(e, _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale)));
    // 8 x int32 in [-127, 127] -> 8 x int8, in order
    const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(v),
                                           _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(halves, halves));
  }
  return body;
}

// Initialised while the library loads, so the CPU model must be set up explicitly first.
const bool kHasAVX2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

template <typename F>
void quantize_block(float* err, int8_t* q, float s, int64_t n) {
  int64_t done = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (kHasAVX2) done = quantize_avx2<F>(err, q, s, n);
#endif
  quantize_scalar<F>(err, q, s, done, n);
}

// The block's bytes: intq::place of each value (int4: element 2j in the low nibble of byte j).
template <typename F>
inline void place_block(const int8_t* q, uint8_t* bytes, int64_t n) {
  if constexpr (intq::per_byte<F>() == 1) {
    std::memcpy(bytes, q, n);
  } else {
    static_assert(intq::per_byte<F>() == 2, "place_block: int8 or int4");
    for (int64_t b = 0; b < n / 2; ++b) {
      bytes[b] = static_cast<uint8_t>((q[2 * b] & 0x0f) | ((q[2 * b + 1] & 0x0f) << 4));
    }
    if (n % 2) bytes[n / 2] = static_cast<uint8_t>(q[n - 1] & 0x0f);  // no element above it
  }
}

// After a block's pass 2: adds sum r^2 of its residuals r (in the units they were quantised in) to
// *e2, then (kUnits) writes r * u back: the memory is kept in plain units.
template <bool kUnits>
CIUICFLOW_HOT void ef_residual(float* __restrict__ err, const float* __restrict__ u, int64_t n,
                               double* e2) {
  Lanes lanes = {};
  const int64_t body = n - n % 8;
  for (int64_t k = 0; k < body; k += 8) {
    Lanes r;
    std::memcpy(&r, err + k, sizeof r);
    lanes += r * r;
    if constexpr (kUnits) {
      Lanes w;
      std::memcpy(&w, u + k, sizeof w);
      r = r * w;
      std::memcpy(err + k, &r, sizeof r);
    }
  }
  double squares = 0.0;
  for (int k = 0; k < 8; ++k) squares += lanes[k];
  for (int64_t k = body; k < n; ++k) {
    squares += static_cast<double>(err[k]) * err[k];
    if constexpr (kUnits) err[k] = err[k] * u[k];
  }
  *e2 += squares;
}

struct EfSums {
  double e2 = 0.0, x2 = 0.0;
};

// A chunk: its scale, its bytes, its new error in err (which may be err_in); with kSums, the
// guard's sums added to sums.
template <typename F, bool kScaled, bool kUnits, bool kSums, typename scalar_t>
void pack_chunk(const scalar_t* x, const float* err_in, float decay, const float* u, float* err,
                uint8_t* bytes, float* scale, int64_t len, EfSums& sums) {
  bool nan = false;
  const float amax = ef_add_error_amax<kScaled, kUnits, kSums>(x, err_in, decay, u, err, len,
                                                               &nan, &sums.x2);
  const float s = nan ? NAN : amax / F::kLevels;
  *scale = s;
  if (!(s > 0.0f) || !(s < INFINITY)) {  // every value quantises to 0 (intq::quantize)
    const float sent = static_cast<float>(0) * s;
    for (int64_t i = 0; i < len; ++i) err[i] = err[i] - sent;
    std::memset(bytes, 0, intq::payload_bytes<F>(len));
    if constexpr (kSums || kUnits) ef_residual<kUnits>(err, u, len, &sums.e2);
    return;
  }
  int8_t q[kBlock];
  // blocks start at even offsets in the chunk: whole bytes
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t n = std::min(kBlock, len - start);
    quantize_block<F>(err + start, q, s, n);
    place_block<F>(q, bytes + start / intq::per_byte<F>(), n);
    if constexpr (kSums || kUnits) {
      ef_residual<kUnits>(err + start, kUnits ? u + start : nullptr, n, &sums.e2);
    }
  }
}

// error and error_out: the same tensor or apart (a partial overlap would read what was written).
inline bool apart_or_same(const at::Tensor& a, const at::Tensor& b) {
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  return pa == pb || pa + a.numel() <= pb || pb + b.numel() <= pa;
}

// intq_pack of y = x / u + error_decay * (error / u) with the new error (times u) in error_out, and
// float64 (sum of the new error^2 in the units, sum (x / u)^2): the torch ops
//   xu = x.float() / units; eu = error / units; error_out = error_decay * eu (eu where 1);
//   pack(xu, error_out); sums; error_out *= units
// in one pass over memory (units None: 1, and no division or multiply).
template <typename F>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_ef_cpu(
    const at::Tensor& x, const at::Tensor& error, double error_decay, at::Tensor& error_out,
    int64_t chunk_size, const std::optional<at::Tensor>& units) {
  intq::check_pack<F>(x, error, chunk_size);
  const int64_t n = x.numel();
  TORCH_CHECK(error_out.scalar_type() == at::kFloat && error_out.is_contiguous() &&
                  error_out.numel() == n && error_out.device() == x.device(),
              F::kName, "_pack_ef: error_out must be a contiguous float32 tensor of ", n,
              " elements on ", x.device(), ", got ", error_out.scalar_type(), " ",
              error_out.sizes(), " on ", error_out.device());
  TORCH_CHECK(apart_or_same(error, error_out), F::kName,
              "_pack_ef: error and error_out must be one tensor or not overlap");
  const bool with_units = units.has_value() && units->defined();
  if (with_units) {
    TORCH_CHECK(units->scalar_type() == at::kFloat && units->is_contiguous() &&
                    units->numel() == n && units->device() == x.device(),
                F::kName, "_pack_ef: units must be a contiguous float32 tensor of ", n,
                " elements on ", x.device(), ", got ", units->scalar_type(), " ",
                units->sizes(), " on ", units->device());
  }
  const int64_t nchunks = intq::chunks(n, chunk_size);
  auto xc = x.contiguous();
  auto values = at::empty({intq::payload_bytes<F>(n)}, x.options().dtype(F::kDtype));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  const float* err_in = error.const_data_ptr<float>();
  float* err = error_out.data_ptr<float>();
  const float* u = with_units ? units->const_data_ptr<float>() : nullptr;
  uint8_t* vp = static_cast<uint8_t*>(values.data_ptr());
  float* sp = scales.data_ptr<float>();
  const int64_t chunk_bytes = chunk_size / intq::per_byte<F>();
  const float decay = static_cast<float>(error_decay);
  const bool scaled = decay != 1.0f;
  using Pair = std::pair<double, double>;
  Pair total(0.0, 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "intq_pack_ef", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    total = at::parallel_reduce(
        0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size), Pair(0.0, 0.0),
        [&](int64_t c0, int64_t c1, Pair acc) {
          EfSums sums;
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t begin = c * chunk_size, len = std::min(chunk_size, n - begin);
            const float* uc = with_units ? u + begin : nullptr;
            auto chunk = [&](auto scaled_tag, auto units_tag) {
              pack_chunk<F, decltype(scaled_tag)::value, decltype(units_tag)::value, true>(
                  xp + begin, err_in + begin, decay, uc, err + begin, vp + c * chunk_bytes,
                  sp + c, len, sums);
            };
            if (scaled) {
              with_units ? chunk(std::true_type{}, std::true_type{})
                         : chunk(std::true_type{}, std::false_type{});
            } else {
              with_units ? chunk(std::false_type{}, std::true_type{})
                         : chunk(std::false_type{}, std::false_type{});
            }
          }
          return Pair(acc.first + sums.e2, acc.second + sums.x2);
        },
        [](Pair a, Pair b) { return Pair(a.first + b.first, a.second + b.second); });
  });
  return {values, scales, at::tensor({total.first, total.second}, x.options().dtype(at::kDouble))};
}

template <typename F>
std::tuple<at::Tensor, at::Tensor> pack_cpu(const at::Tensor& x, at::Tensor& error,
                                            int64_t chunk_size) {
  intq::check_pack<F>(x, error, chunk_size);
  const int64_t n = x.numel(), nchunks = intq::chunks(n, chunk_size);
  auto xc = x.contiguous();
  auto values = at::empty({intq::payload_bytes<F>(n)}, x.options().dtype(F::kDtype));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  float* err = error.data_ptr<float>();
  uint8_t* vp = static_cast<uint8_t*>(values.data_ptr());
  float* sp = scales.data_ptr<float>();
  const int64_t chunk_bytes = chunk_size / intq::per_byte<F>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "intq_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size),
                     [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * chunk_size, len = std::min(chunk_size, n - begin);
        EfSums unused;
        pack_chunk<F, false, false, false>(xp + begin, err + begin, 1.0f, nullptr, err + begin,
                                           vp + c * chunk_bytes, sp + c, len, unused);
      }
    });
  });
  return {values, scales};
}

// A block's signed values from a packed row (n elements from element `begin`, which is even).
template <typename F>
inline void decode_block(const uint8_t* row, int64_t begin, int8_t* q, int64_t n) {
  if constexpr (intq::per_byte<F>() == 1) {
    std::memcpy(q, row + begin, n);
  } else {
    const uint8_t* bytes = row + begin / 2;
    for (int64_t b = 0; b < n / 2; ++b) {
      q[2 * b] = static_cast<int8_t>(static_cast<int8_t>(bytes[b] << 4) >> 4);
      q[2 * b + 1] = static_cast<int8_t>(static_cast<int8_t>(bytes[b]) >> 4);
    }
    if (n % 2) q[n - 1] = static_cast<int8_t>(static_cast<int8_t>(bytes[n / 2] << 4) >> 4);
  }
}

// sum (+)= q * s over a block; the first row adds its terms to 0.0f, as the scalar sum starts.
// A NaN sum stays the NaN it is, as the scalar sum + term keeps its first operand's: the
// compiler may swap the operands of a vector add, so that choice is made here.
CIUICFLOW_HOT void accumulate_block(const int8_t* __restrict__ q, float s,
                                    float* __restrict__ sum, int64_t n, bool first) {
  if (first) {
    for (int64_t k = 0; k < n; ++k) sum[k] = 0.0f + static_cast<float>(q[k]) * s;
  } else {
    for (int64_t k = 0; k < n; ++k) {
      const float total = sum[k] + static_cast<float>(q[k]) * s;
      sum[k] = sum[k] != sum[k] ? sum[k] : total;
    }
  }
}

CIUICFLOW_HOT void scale_block(const float* __restrict__ sum, float factor,
                               float* __restrict__ out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = sum[k] * factor;
}

// out = mean over the W rows of values * scale, summed in row order (the same bits on every rank).
// Rows may lie apart (values' last stride must be 1): read where they are.
template <typename F>
void unpack_rows(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                 int64_t chunk_size, at::Tensor& out, int64_t world) {
  auto vc = values.stride(-1) == 1 ? values : values.contiguous();
  auto sc = scales.contiguous();
  const int64_t nchunks = intq::chunks(numel, chunk_size);
  const int64_t row_stride = vc.dim() == 2 ? vc.stride(0) : 0;
  const uint8_t* v = static_cast<const uint8_t*>(vc.const_data_ptr());
  const float* s = sc.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float inv_world = 1.0f / static_cast<float>(world);
  at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size),
                   [&](int64_t c0, int64_t c1) {
    int8_t q[kBlock];
    float sum[kBlock];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t chunk_begin = c * chunk_size;
      const int64_t chunk_end = std::min(chunk_begin + chunk_size, numel);
      for (int64_t begin = chunk_begin; begin < chunk_end; begin += kBlock) {
        const int64_t n = std::min(kBlock, chunk_end - begin);
        for (int64_t w = 0; w < world; ++w) {
          decode_block<F>(v + w * row_stride, begin, q, n);
          accumulate_block(q, s[w * nchunks + c], sum, n, w == 0);
        }
        scale_block(sum, inv_world, o + begin, n);
      }
    }
  });
}

template <typename F>
void unpack_into_cpu(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                     int64_t chunk_size, at::Tensor& out) {
  intq::check_unpack<F>(F::kUnpack, values, scales, numel, chunk_size, 1, out);
  unpack_rows<F>(values, scales, numel, chunk_size, out, 1);
}

template <typename F>
void unpack_mean_into_cpu(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                          int64_t chunk_size, at::Tensor& out) {
  intq::check_unpack<F>(F::kUnpackMean, values, scales, numel, chunk_size, 2, out);
  unpack_rows<F>(values, scales, numel, chunk_size, out, values.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // error is updated in place; returns (values, scales float32[ceil(n/chunk_size)]): int8[n] for
  // int8, uint8[ceil(n/2)] (two 4-bit values per byte) for int4
  m.def("int8_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
  m.def("int8_unpack_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  // values [W, bytes], scales [W, nchunks] -> the mean of the W vectors, into out
  m.def("int8_unpack_mean_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  m.def("int4_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
  // the pack of y = x / units + error_decay * error / units (units None: 1) with the new error, times
  // units, in error_out (which may be error), and float64 (sum new error^2 in the units, sum
  // (x / units)^2): the error feedback, the optimizer's units and the guard's sums in one pass
  m.def("int8_pack_ef(Tensor x, Tensor error, float error_decay, Tensor(a!) error_out, int chunk_size, Tensor? units=None) -> (Tensor, Tensor, Tensor)");
  m.def("int4_pack_ef(Tensor x, Tensor error, float error_decay, Tensor(a!) error_out, int chunk_size, Tensor? units=None) -> (Tensor, Tensor, Tensor)");
  m.def("int4_unpack_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  m.def("int4_unpack_mean_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("int8_pack", &pack_cpu<intq::Int8>);
  m.impl("int8_unpack_into", &unpack_into_cpu<intq::Int8>);
  m.impl("int8_unpack_mean_into", &unpack_mean_into_cpu<intq::Int8>);
  m.impl("int4_pack", &pack_cpu<intq::Int4>);
  m.impl("int8_pack_ef", &pack_ef_cpu<intq::Int8>);
  m.impl("int4_pack_ef", &pack_ef_cpu<intq::Int4>);
  m.impl("int4_unpack_into", &unpack_into_cpu<intq::Int4>);
  m.impl("int4_unpack_mean_into", &unpack_mean_into_cpu<intq::Int4>);
}

}  // namespace ciuicflow
