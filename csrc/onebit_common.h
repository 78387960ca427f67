// Argument checks shared by the CPU and CUDA registrations of the 1-bit ops.
#pragma once
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

namespace ciuicflow {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void check_chunk_size(int64_t chunk_size) {
  TORCH_CHECK(chunk_size > 0 && chunk_size % 8 == 0,
              "ciuicflow: chunk_size must be a positive multiple of 8 (chunks are whole bytes), got ",
              chunk_size);
}

inline void check_pack_args(const at::Tensor& x, const at::Tensor& error, int64_t chunk_size) {
  check_chunk_size(chunk_size);
  TORCH_CHECK(x.dim() == 1, "onebit_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              "onebit_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat, "onebit_pack: error must be float32, got ",
              error.scalar_type());
  TORCH_CHECK(error.numel() == x.numel(), "onebit_pack: error has ", error.numel(),
              " elements, x has ", x.numel());
  TORCH_CHECK(error.is_contiguous(), "onebit_pack: error must be contiguous (it is updated in place)");
  TORCH_CHECK(x.device() == error.device(), "onebit_pack: x is on ", x.device(), ", error on ",
              error.device());
  // the kernels read x while they write the error: one buffer for both would be read half-updated
  TORCH_CHECK(at::get_overlap_status(x, error) == at::MemOverlapStatus::No,
              "onebit_pack: x and the error buffer it writes must not share memory");
}

// onebit_pack_ef's arguments: error_out as onebit_pack's error, and error (read) beside it: the
// same length and device, float32, contiguous. The two may be one tensor.
inline void check_pack_ef_args(const at::Tensor& x, const at::Tensor& error,
                               const at::Tensor& error_out, int64_t chunk_size) {
  const char* op = "onebit_pack_ef";
  check_pack_args(x, error_out, chunk_size);
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous(), op,
              ": error must be a contiguous float32 tensor, got ", error.scalar_type());
  TORCH_CHECK(error.numel() == error_out.numel(), op, ": error has ", error.numel(),
              " elements, error_out ", error_out.numel());
  TORCH_CHECK(error.device() == error_out.device(), op, ": error is on ", error.device(),
              ", error_out on ", error_out.device());
  const auto overlap = at::get_overlap_status(error, error_out);
  TORCH_CHECK(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::Full, op,
              ": error and error_out must be one tensor or not share memory");
}

// packed/scales may be 1-D (one vector) or 2-D [W, ...] (W vectors, for unpack_mean).
inline void check_unpack_args(const char* op, const at::Tensor& packed, const at::Tensor& scales,
                              int64_t numel, int64_t chunk_size, int64_t dims) {
  check_chunk_size(chunk_size);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(packed.scalar_type() == at::kByte, op, ": packed must be uint8, got ",
              packed.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(packed.dim() == dims && scales.dim() == dims, op, ": packed and scales must be ",
              dims, "-D, got ", packed.sizes(), " and ", scales.sizes());
  TORCH_CHECK(packed.size(-1) == ceil_div(numel, 8), op, ": packed has ", packed.size(-1),
              " bytes per vector, numel ", numel, " needs ", ceil_div(numel, 8));
  TORCH_CHECK(scales.size(-1) == ceil_div(numel, chunk_size), op, ": scales has ", scales.size(-1),
              " entries per vector, numel ", numel, " with chunk_size ", chunk_size, " needs ",
              ceil_div(numel, chunk_size));
  if (dims == 2) {
    TORCH_CHECK(packed.size(0) == scales.size(0), op, ": packed has ", packed.size(0),
                " vectors, scales ", scales.size(0));
    TORCH_CHECK(packed.size(0) > 0, op, ": needs at least one vector");
  }
  TORCH_CHECK(packed.device() == scales.device(), op, ": packed is on ", packed.device(),
              ", scales on ", scales.device());
}

inline void check_out(const char* op, const at::Tensor& out, int64_t numel,
                      const at::Tensor& like) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == numel, op,
              ": out must be a contiguous float32 tensor of ", numel, " elements, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(out.device() == like.device(), op, ": out is on ", out.device(), ", inputs on ",
              like.device());
}

inline void check_orthogonalize_args(const at::Tensor& m) {
  TORCH_CHECK(m.dim() == 2 || m.dim() == 3, "orthogonalize_: m must be [n, r] or [B, n, r], got ",
              m.sizes());
  TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == at::kHalf ||
                  m.scalar_type() == at::kBFloat16,
              "orthogonalize_: m must be float32, float16 or bfloat16, got ", m.scalar_type());
}

// Gram-Schmidt works on a float32 copy whose rows are m's columns: [B, r, n], contiguous.
inline at::Tensor columns_as_float_rows(const at::Tensor& m) {
  auto batched = m.dim() == 2 ? m.unsqueeze(0) : m;
  return batched.to(at::kFloat).transpose(1, 2).contiguous();
}

inline void write_back_columns(at::Tensor& m, const at::Tensor& rows) {
  auto batched = m.dim() == 2 ? m.unsqueeze(0) : m;
  batched.copy_(rows.transpose(1, 2));
}

}  // namespace ciuicflow
