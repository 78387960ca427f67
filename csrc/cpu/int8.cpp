// int8 quantisation with error feedback: schemas and CPU kernels. One scale (max |y| / 127) per
// chunk; work is split by chunk, each chunk's two passes (scale, then values and error) from cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "int8_common.h"

namespace ciuicflow {
namespace {

constexpr int64_t kGrainElements = 1 << 16;  // below this, threads cost more than they save

template <typename scalar_t>
void pack_chunk(const scalar_t* x, float* err, int8_t* q, float* scale, int64_t len) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < len; ++i) {
    const float y = static_cast<float>(x[i]) + err[i];
    err[i] = y;
    const float a = std::fabs(y);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  const float s = nan ? NAN : amax / int8q::kLevels;
  *scale = s;
  for (int64_t i = 0; i < len; ++i) {
    const int8_t v = int8q::quantize(err[i], s);
    q[i] = v;
    const float sent = static_cast<float>(v) * s;
    err[i] = err[i] - sent;
  }
}

std::tuple<at::Tensor, at::Tensor> int8_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                   int64_t chunk_size) {
  int8q::check_pack(x, error, chunk_size);
  const int64_t n = x.numel(), nchunks = int8q::chunks(n, chunk_size);
  auto xc = x.contiguous();
  auto q = at::empty({n}, x.options().dtype(at::kChar));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  float* err = error.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "int8_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size),
                     [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * chunk_size, len = std::min(chunk_size, n - begin);
        pack_chunk(xp + begin, err + begin, qp + begin, sp + c, len);
      }
    });
  });
  return {q, scales};
}

// out = mean over the W rows of values * scale, summed in row order (the same bits on every rank).
void unpack_rows(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                 int64_t chunk_size, at::Tensor& out, int64_t world) {
  auto vc = values.contiguous();
  auto sc = scales.contiguous();
  const int64_t nchunks = int8q::chunks(numel, chunk_size);
  const int8_t* v = vc.const_data_ptr<int8_t>();
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
          const float term = static_cast<float>(v[w * numel + i]) * s[w * nchunks + c];
          sum = sum + term;
        }
        o[i] = sum * inv_world;
      }
    }
  });
}

void int8_unpack_into_cpu(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                          int64_t chunk_size, at::Tensor& out) {
  int8q::check_unpack("int8_unpack", values, scales, numel, chunk_size, 1, out);
  unpack_rows(values, scales, numel, chunk_size, out, 1);
}

void int8_unpack_mean_into_cpu(const at::Tensor& values, const at::Tensor& scales, int64_t numel,
                               int64_t chunk_size, at::Tensor& out) {
  int8q::check_unpack("int8_unpack_mean", values, scales, numel, chunk_size, 2, out);
  unpack_rows(values, scales, numel, chunk_size, out, values.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // error is updated in place; returns (values int8[n], scales float32[ceil(n/chunk_size)])
  m.def("int8_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
  m.def("int8_unpack_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  // values [W, n], scales [W, nchunks] -> the mean of the W vectors, into out
  m.def("int8_unpack_mean_into(Tensor values, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) {
  m.impl("int8_pack", &int8_pack_cpu);
  m.impl("int8_unpack_into", &int8_unpack_into_cpu);
  m.impl("int8_unpack_mean_into", &int8_unpack_mean_into_cpu);
}

}  // namespace ciuicflow
