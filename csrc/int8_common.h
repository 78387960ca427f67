// The int8 ops' schemas, argument checks and per-element arithmetic, shared by the CPU and CUDA
// kernels so both give the same bits.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CIUICFLOW_HD __host__ __device__
#else
#define CIUICFLOW_HD
#endif

namespace ciuicflow {
namespace int8q {

// A chunk's scale: max |y| / 127, NaN when the chunk holds a NaN (inf stays inf), so a non-finite
// chunk unpacks to non-finite values and its error becomes non-finite, as in the 1-bit ops.
constexpr float kLevels = 127.0f;

// q = round-half-even(y / scale), clamped to [-127, 127]; 0 where the scale is 0 or not finite.
CIUICFLOW_HD inline int8_t quantize(float y, float scale) {
  if (!(scale > 0.0f) || !(scale < INFINITY)) return 0;
  float q = rintf(y / scale);
  q = q > kLevels ? kLevels : (q < -kLevels ? -kLevels : q);
  return static_cast<int8_t>(q);
}

inline void check_chunk(int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0, "ciuicflow: int8 chunk_size must be positive, got ", chunk_size);
}

inline int64_t chunks(int64_t n, int64_t chunk_size) { return (n + chunk_size - 1) / chunk_size; }

inline void check_pack(const at::Tensor& x, const at::Tensor& error, int64_t chunk_size) {
  check_chunk(chunk_size);
  TORCH_CHECK(x.dim() == 1, "int8_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              "int8_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
                  error.numel() == x.numel(),
              "int8_pack: error must be a contiguous float32 tensor of ", x.numel(),
              " elements, got ", error.scalar_type(), " ", error.sizes());
  TORCH_CHECK(x.device() == error.device(), "int8_pack: x is on ", x.device(), ", error on ",
              error.device());
}

// values [n] or [W, n] int8, scales [ceil(n/chunk)] or [W, ...] float32, out float32 [n].
inline void check_unpack(const char* op, const at::Tensor& values, const at::Tensor& scales,
                         int64_t numel, int64_t chunk_size, int64_t dims, const at::Tensor& out) {
  check_chunk(chunk_size);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(values.scalar_type() == at::kChar, op, ": values must be int8, got ",
              values.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(values.dim() == dims && scales.dim() == dims, op, ": values and scales must be ",
              dims, "-D, got ", values.sizes(), " and ", scales.sizes());
  TORCH_CHECK(values.size(-1) == numel, op, ": values has ", values.size(-1),
              " elements per vector, numel is ", numel);
  TORCH_CHECK(scales.size(-1) == chunks(numel, chunk_size), op, ": scales has ", scales.size(-1),
              " entries per vector, numel ", numel, " with chunk_size ", chunk_size, " needs ",
              chunks(numel, chunk_size));
  if (dims == 2) {
    TORCH_CHECK(values.size(0) == scales.size(0) && values.size(0) > 0, op,
                ": values and scales need the same, nonzero number of vectors, got ",
                values.size(0), " and ", scales.size(0));
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == numel, op,
              ": out must be a contiguous float32 tensor of ", numel, " elements, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(values.device() == scales.device() && values.device() == out.device(), op,
              ": values, scales and out must be on one device");
}

}  // namespace int8q
}  // namespace ciuicflow
