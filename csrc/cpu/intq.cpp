// Integer quantisation with error feedback (int8, int4): schemas and CPU kernels. One scale
// (max |y| / levels) per chunk; work is split by chunk, each chunk's two passes (scale, then values
// and error) from cache. A chunk holds whole bytes of payload, so chunks never share a byte.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_common.h"
#include "intq_common.h"

namespace ciuicflow {
namespace {

template <typename F, typename scalar_t>
void pack_chunk(const scalar_t* x, float* err, uint8_t* bytes, float* scale, int64_t len) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < len; ++i) {
    const float y = static_cast<float>(x[i]) + err[i];
    err[i] = y;
    const float a = std::fabs(y);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  const float s = nan ? NAN : amax / F::kLevels;
  *scale = s;
  constexpr int kPer = intq::per_byte<F>();
  for (int64_t b = 0; b * kPer < len; ++b) {
    uint32_t byte = 0;
    for (int k = 0; k < kPer && b * kPer + k < len; ++k) {
      const int64_t i = b * kPer + k;
      const int v = intq::quantize<F>(err[i], s);
      byte |= intq::place<F>(v, k);
      const float sent = static_cast<float>(v) * s;
      err[i] = err[i] - sent;
    }
    bytes[b] = static_cast<uint8_t>(byte);
  }
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
        pack_chunk<F>(xp + begin, err + begin, vp + c * chunk_bytes, sp + c, len);
      }
    });
  });
  return {values, scales};
}

// out = mean over the W rows of values * scale, summed in row order (the same bits on every rank).
template <typename F>
void unpack_rows(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                 int64_t chunk_size, at::Tensor& out, int64_t world) {
  auto vc = values.contiguous();
  auto sc = scales.contiguous();
  const int64_t nchunks = intq::chunks(numel, chunk_size), row_bytes = intq::payload_bytes<F>(numel);
  const uint8_t* v = static_cast<const uint8_t*>(vc.const_data_ptr());
  const float* s = sc.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float inv_world = 1.0f / static_cast<float>(world);
  at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size),
                   [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size, len = std::min(chunk_size, numel - begin);
      for (int64_t i = begin; i < begin + len; ++i) {
        float sum = 0.0f;
        for (int64_t w = 0; w < world; ++w) {
          const float term = static_cast<float>(intq::decode<F>(v + w * row_bytes, i)) *
                             s[w * nchunks + c];
          sum = sum + term;
        }
        o[i] = sum * inv_world;
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
  m.def("int4_unpack_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  m.def("int4_unpack_mean_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("int8_pack", &pack_cpu<intq::Int8>);
  m.impl("int8_unpack_into", &unpack_into_cpu<intq::Int8>);
  m.impl("int8_unpack_mean_into", &unpack_mean_into_cpu<intq::Int8>);
  m.impl("int4_pack", &pack_cpu<intq::Int4>);
  m.impl("int4_unpack_into", &unpack_into_cpu<intq::Int4>);
  m.impl("int4_unpack_mean_into", &unpack_mean_into_cpu<intq::Int4>);
}

}  // namespace ciuicflow
