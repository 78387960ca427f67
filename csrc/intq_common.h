// Integer quantisation with one scale per chunk (int8, int4): the formats, argument checks and
// per-element arithmetic, shared by the CPU and CUDA kernels so both give the same bits.
//
// A format packs kPerByte values of kBits bits into each byte, element i in byte i / kPerByte at
// bit kBits * (i % kPerByte), two's complement; values lie in [-kLevels, kLevels]. int8's payload is
// its values as a signed byte each (the int8 ops' dtype is int8), int4's two nibbles per byte (uint8).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace ciuicflow {
namespace intq {

struct Int8 {
  static constexpr int kBits = 8;
  static constexpr float kLevels = 127.0f;
  static constexpr const char* kName = "int8";
  static constexpr at::ScalarType kDtype = at::kChar;
  static constexpr const char* kDtypeName = "int8";
  static constexpr const char* kUnpack = "int8_unpack";
  static constexpr const char* kUnpackMean = "int8_unpack_mean";
};

struct Int4 {
  static constexpr int kBits = 4;
  static constexpr float kLevels = 7.0f;
  static constexpr const char* kName = "int4";
  static constexpr at::ScalarType kDtype = at::kByte;
  static constexpr const char* kDtypeName = "uint8";
  static constexpr const char* kUnpack = "int4_unpack";
  static constexpr const char* kUnpackMean = "int4_unpack_mean";
};

template <typename F>
CIUICFLOW_HD constexpr int per_byte() { return 8 / F::kBits; }

// A chunk's scale is max |y| / kLevels, NaN when the chunk holds a NaN (inf stays inf), so a
// non-finite chunk unpacks to non-finite values and its error becomes non-finite, as in the 1-bit
// ops. q = round-half-even(y / scale), clamped to [-kLevels, kLevels]; 0 where the scale is 0 or
// not finite.
template <typename F>
CIUICFLOW_HD inline int quantize(float y, float scale) {
  if (!(scale > 0.0f) || !(scale < INFINITY)) return 0;
  float q = rintf(y / scale);
  q = q > F::kLevels ? F::kLevels : (q < -F::kLevels ? -F::kLevels : q);
  return static_cast<int>(q);
}

// The bits of value v at slot k of its byte.
template <typename F>
CIUICFLOW_HD inline uint32_t place(int v, int k) {
  return (static_cast<uint32_t>(v) & ((1u << F::kBits) - 1u)) << (F::kBits * k);
}

// The signed value of element i of a packed row.
template <typename F>
CIUICFLOW_HD inline int decode(const uint8_t* row, int64_t i) {
  const int k = static_cast<int>(i % per_byte<F>());
  const int bits = (row[i / per_byte<F>()] >> (F::kBits * k)) & ((1 << F::kBits) - 1);
  return bits >= (1 << (F::kBits - 1)) ? bits - (1 << F::kBits) : bits;
}

inline int64_t chunks(int64_t n, int64_t chunk_size) { return (n + chunk_size - 1) / chunk_size; }

template <typename F>
inline int64_t payload_bytes(int64_t n) { return (n + per_byte<F>() - 1) / per_byte<F>(); }

template <typename F>
inline void check_chunk(int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0, "ciuicflow: ", F::kName, " chunk_size must be positive, got ",
              chunk_size);
  TORCH_CHECK(chunk_size % per_byte<F>() == 0, "ciuicflow: ", F::kName, " chunk_size must be a ",
              "multiple of ", per_byte<F>(), " (whole bytes per chunk), got ", chunk_size);
}

template <typename F>
inline void check_pack(const at::Tensor& x, const at::Tensor& error, int64_t chunk_size) {
  check_chunk<F>(chunk_size);
  TORCH_CHECK(x.dim() == 1, F::kName, "_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              F::kName, "_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
                  error.numel() == x.numel(),
              F::kName, "_pack: error must be a contiguous float32 tensor of ", x.numel(),
              " elements, got ", error.scalar_type(), " ", error.sizes());
  TORCH_CHECK(x.device() == error.device(), F::kName, "_pack: x is on ", x.device(), ", error on ",
              error.device());
}

// values [bytes] or [W, bytes] of the format's dtype, scales [ceil(n/chunk)] or [W, ...] float32,
// out float32 [n].
template <typename F>
inline void check_unpack(const char* op, const at::Tensor& values, const at::Tensor& scales,
                         int64_t numel, int64_t chunk_size, int64_t dims, const at::Tensor& out) {
  check_chunk<F>(chunk_size);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(values.scalar_type() == F::kDtype, op, ": values must be ", F::kDtypeName, ", got ",
              values.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(values.dim() == dims && scales.dim() == dims, op, ": values and scales must be ",
              dims, "-D, got ", values.sizes(), " and ", scales.sizes());
  TORCH_CHECK(values.size(-1) == payload_bytes<F>(numel), op, ": values has ", values.size(-1),
              " bytes per vector, numel ", numel, " needs ", payload_bytes<F>(numel));
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

}  // namespace intq
}  // namespace ciuicflow
