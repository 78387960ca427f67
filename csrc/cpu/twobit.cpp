// 2-bit compression with error feedback (ciuicflow/compression/twobit.py has the format and why):
// the pack's schema and CPU kernel. Per chunk three passes from cache: y = x + error and its sum of
// squares; the sums of the large (|y| > 0.9816 RMS) and the small magnitudes; the codes and the
// new error. The unpack is torch ops in the codec (a gather per row: as fast as int4's native one).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "cpu_common.h"

namespace ciuicflow {
namespace {

constexpr float kThreshold = 0.9816f;  // x the chunk's RMS (twobit.THRESHOLD)

int64_t block_bytes(int64_t len) { return 1 + (len + 3) / 4; }

int64_t payload_bytes(int64_t n, int64_t chunk) {
  const int64_t full = n / chunk, rest = n % chunk;
  return full * (1 + chunk / 4) + (rest ? block_bytes(rest) : 0);
}

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
  const float n_small = static_cast<float>(len) - n_large;
  const float lo = n_small > 0.0f ? (sum_all - sum_large) / n_small : 0.0f;
  float hi = n_large > 0.0f ? sum_large / n_large : lo;  // all small: hi carries lo
  float ratio = hi > 0.0f ? std::nearbyint(lo / hi * 255.0f) : 0.0f;
  ratio = ratio != ratio ? 0.0f : std::min(255.0f, std::max(0.0f, ratio));
  if (!std::isfinite(rms)) hi = NAN;  // a chunk holding inf/NaN says so
  const float lo_sent = hi * ratio / 255.0f;
  block[0] = static_cast<uint8_t>(ratio);
  *scale = hi;
  const float levels[4] = {lo_sent, -lo_sent, hi, -hi};  // by code: bit 0 sign, bit 1 level
  for (int64_t b = 0; b * 4 < len; ++b) {
    uint32_t byte = 0;
    for (int k = 0; k < 4 && b * 4 + k < len; ++k) {
      const int64_t i = b * 4 + k;
      const float y = err[i];
      const uint32_t code = static_cast<uint32_t>(y < 0.0f) |
                            (static_cast<uint32_t>(std::fabs(y) > threshold) << 1);
      err[i] = y - levels[code];
      byte |= code << (2 * k);
    }
    block[1 + b] = static_cast<uint8_t>(byte);
  }
}

std::tuple<at::Tensor, at::Tensor> twobit_pack_cpu(const at::Tensor& x, at::Tensor& error,
                                                   int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0 && chunk_size % 4 == 0,
              "twobit_pack: chunk_size must be a positive multiple of 4, got ", chunk_size);
  TORCH_CHECK(x.dim() == 1, "twobit_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              "twobit_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
                  error.numel() == x.numel() && error.device() == x.device(),
              "twobit_pack: error must be a contiguous float32 tensor of ", x.numel(),
              " elements on x's device, got ", error.scalar_type(), " ", error.sizes());
  const int64_t n = x.numel(), nchunks = (n + chunk_size - 1) / chunk_size;
  auto xc = x.contiguous();
  auto payload = at::empty({payload_bytes(n, chunk_size)}, x.options().dtype(at::kByte));
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
