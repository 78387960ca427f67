// 2-bit compression with error feedback (ciuicflow/compression/twobit.py has the format and why):
// the layout's sizes, the argument checks and a chunk's magnitudes from its sums, shared by the
// CPU and CUDA packs so both send the same bytes for the same sums.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace ciuicflow {
namespace twobit {

constexpr float kThreshold = 0.9816f;  // x the chunk's RMS (twobit.THRESHOLD)

// [lo byte | ceil(len / 4) bytes of codes] per chunk
CIUICFLOW_HD inline int64_t block_bytes(int64_t len) { return 1 + (len + 3) / 4; }

inline int64_t payload_bytes(int64_t n, int64_t chunk) {
  const int64_t full = n / chunk, rest = n % chunk;
  return full * (1 + chunk / 4) + (rest ? block_bytes(rest) : 0);
}

inline void check_pack(const at::Tensor& x, const at::Tensor& error, int64_t chunk_size) {
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
}

// What a chunk sends, from its sums: hi (the float32 scale), the lo byte, and the two magnitudes
// the codes stand for. No fused multiply-adds here: nvcc and the host compiler give the same bits.
struct Magnitudes {
  float hi;
  float lo_byte;  // round(255 lo / hi), in [0, 255]
  float lo_sent;  // hi x lo_byte / 255: what the receiver decodes for a small element
};

CIUICFLOW_HD inline Magnitudes magnitudes(float rms, float sum_all, float sum_large,
                                          float n_large, float len) {
  const float n_small = len - n_large;
  const float lo = n_small > 0.0f ? (sum_all - sum_large) / n_small : 0.0f;
  float hi = n_large > 0.0f ? sum_large / n_large : lo;  // all small: hi carries lo
  float ratio = hi > 0.0f ? rintf(lo / hi * 255.0f) : 0.0f;
  ratio = ratio != ratio ? 0.0f : (ratio > 255.0f ? 255.0f : (ratio < 0.0f ? 0.0f : ratio));
  if (!(fabsf(rms) < INFINITY)) hi = NAN;  // a chunk holding inf/NaN says so
  return {hi, ratio, hi * ratio / 255.0f};
}

// Element y's code: bit 0 its sign (1: negative), bit 1 its level (1: hi)
CIUICFLOW_HD inline uint32_t code(float y, float threshold) {
  return static_cast<uint32_t>(y < 0.0f) | (static_cast<uint32_t>(fabsf(y) > threshold) << 1);
}

}  // namespace twobit
}  // namespace ciuicflow
