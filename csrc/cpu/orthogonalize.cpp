// CPU Gram-Schmidt (the modified form, as PyTorch's PowerSGD uses) on float32 rows that hold m's
// columns; half-precision inputs are orthogonalised in float32 and rounded once at the end.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "onebit_common.h"

namespace ciuicflow {
namespace {

void gram_schmidt_rows(float* rows, int64_t r, int64_t n, float eps) {
  for (int64_t i = 0; i < r; ++i) {
    float* col = rows + i * n;
    double sq = 0;
    for (int64_t k = 0; k < n; ++k) sq += static_cast<double>(col[k]) * col[k];
    const double denom = std::sqrt(sq) + eps;
    // A zero column (possible with eps == 0) stays zero instead of becoming NaN.
    if (denom != 0.0) {
      const float inv = static_cast<float>(1.0 / denom);
      for (int64_t k = 0; k < n; ++k) col[k] *= inv;
    }
    for (int64_t j = i + 1; j < r; ++j) {
      float* other = rows + j * n;
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += static_cast<double>(col[k]) * other[k];
      const float d = static_cast<float>(dot);
      for (int64_t k = 0; k < n; ++k) other[k] -= d * col[k];
    }
  }
}

void orthogonalize_cpu(at::Tensor& m, double eps) {
  check_orthogonalize_args(m);
  if (m.numel() == 0) return;
  auto rows = columns_as_float_rows(m);  // [B, r, n]
  const int64_t batch = rows.size(0), r = rows.size(1), n = rows.size(2);
  float* data = rows.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) gram_schmidt_rows(data + b * r * n, r, n, static_cast<float>(eps));
  });
  write_back_columns(m, rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) { m.impl("orthogonalize_", &orthogonalize_cpu); }

}  // namespace ciuicflow
