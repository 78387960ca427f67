// 2-bit compression with error feedback (ciuicflow/compression/twobit.py has the format and why):
// the pack's schema and CPU kernel (csrc/cuda/twobit.cu: the CUDA one; twobit_common.h: both's
// sizes, checks and magnitudes). Per chunk three passes from cache: y = x + error and its sum of
// squares; the sums of the large (|y| > 0.9816 RMS) and the small magnitudes; the codes and the
// new error. The unpack is torch ops in the codec (a gather per row: as fast as int4's native one).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "../twobit_common.h"
#include "cpu_common.h"

namespace ciuicflow {
namespace {

using twobit::kThreshold;

template <typename scalar_t>
void pack_chunk(const scalar_t* x, float* err, uint8_t* block, float* scale, int64_t len) {
  // float sums: a chunk is a few hundred elements
  float squares = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float y = static_cast<float>(x[i]) + err[i];
    err[i] = y;
    squares += y * y;
  }
  const float rms = std::sqrt(squares / static_cast<float>(len));
  const float threshold = kThreshold * rms;
  float sum_all = 0.0f, sum_large = 0.0f, n_large = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(err[i]);
    const float large = a > threshold ? 1.0f : 0.0f;
    sum_all += a;
    sum_large += a * large;
    n_large += large;
  }
  const twobit::Magnitudes m =
      twobit::magnitudes(rms, sum_all, sum_large, n_large, static_cast<float>(len));
  block[0] = static_cast<uint8_t>(m.lo_byte);
  *scale = m.hi;
  const float levels[4] = {m.lo_sent, -m.lo_sent, m.hi, -m.hi};  // by code
  for (int64_t b = 0; b * 4 < len; ++b) {
    uint32_t byte = 0;
    for (int k = 0; k < 4 && b * 4 + k < len; ++k) {
      const int64_t i = b * 4 + k;
      const float y = err[i];
      const uint32_t code = twobit::code(y, threshold);
      err[i] = y - levels[code];
      byte |= code << (2 * k);
    }
    block[1 + b] = static_cast<uint8_t>(byte);
  }
}

std::tuple<at::Tensor, at::Tensor> twobit_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                   int64_t chunk_size) {
  twobit::check_pack(x, error, chunk_size);
  const int64_t n = x.numel(), nchunks = (n + chunk_size - 1) / chunk_size;
  auto xc = x.contiguous();
  auto payload = at::empty({twobit::payload_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
  auto scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  float* err = error.data_ptr<float>();
  uint8_t* pp = payload.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const int64_t stride = 1 + chunk_size / 4;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "twobit_pack", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, kGrainElements / chunk_size),
                     [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t begin = c * chunk_size, len = std::min(chunk_size, n - begin);
        pack_chunk(xp + begin, err + begin, pp + c * stride, sp + c, len);
      }
    });
  });
  return {payload, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // error is updated in place; returns (payload uint8, per chunk [lo byte | codes], scales float32)
  m.def("twobit_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) { m.impl("twobit_pack", &twobit_pack_cpu); }

}  // namespace ciuicflow
