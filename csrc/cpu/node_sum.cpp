// The node sum of the intra-node step (ciuicflow/collectives/node_shm.py): each local rank sums its
// shard of every rank's input, divides by the node's rank count and learns whether the result holds
// an inf or NaN. In torch ops that is L-1 adds, a division and a non-finite check, each a pass
// over memory; here it is one read of the inputs and one write of the output.
//
// The result is bit for bit what torch gives for the same sequence: torch.add(t0, t1), then add_
// of each further term in order, then div_(divisor); for float16 and bfloat16 every step rounds to
// the tensor's type, as torch's ops do.
#include <ATen/Parallel.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace ciuicflow {
namespace {

// out[i] = (((t0[i] + t1[i]) + t2[i]) + ...) / divisor over [begin, end); whether any out[i] is
// not finite. divisor 1 skips the division (x / 1 is x).
template <typename T>
bool sum_range(const std::vector<const T*>& terms, float divisor, T* out, int64_t begin,
               int64_t end) {
  const size_t count = terms.size();
  bool nonfinite = false;
  for (int64_t i = begin; i < end; ++i) {
    T acc = terms[0][i];
    for (size_t t = 1; t < count; ++t) acc = static_cast<T>(static_cast<float>(acc) +
                                                            static_cast<float>(terms[t][i]));
    if (divisor != 1.0f) acc = static_cast<T>(static_cast<float>(acc) / divisor);
    out[i] = acc;
    nonfinite |= !std::isfinite(static_cast<float>(acc));
  }
  return nonfinite;
}

// float32 with kTerms terms, a compile-time count, so that the loop over elements vectorizes;
// whether any out[i] is not finite, tested as !(|x| <= FLT_MAX), which NaN fails too.
template <int kTerms>
__attribute__((always_inline)) inline bool sum_fixed(const float* const* terms, float divisor,
                                                     float* __restrict out, int64_t begin,
                                                     int64_t end) {
  const bool divide = divisor != 1.0f;
  int bad = 0;
  for (int64_t i = begin; i < end; ++i) {
    float acc = terms[0][i];
    for (int t = 1; t < kTerms; ++t) acc += terms[t][i];  // in order: torch's bits
    acc = divide ? acc / divisor : acc;
    out[i] = acc;
    bad |= !(std::fabs(acc) <= FLT_MAX);
  }
  return bad != 0;
}

// float32, the hot case: L = 2, 3 or 4 ranks per node, compiled for AVX2 and baseline x86-64
CIUICFLOW_HOT bool sum_range_float(const std::vector<const float*>& terms, float divisor,
                                   float* out, int64_t begin, int64_t end) {
  switch (terms.size()) {
    case 2: return sum_fixed<2>(terms.data(), divisor, out, begin, end);
    case 3: return sum_fixed<3>(terms.data(), divisor, out, begin, end);
    case 4: return sum_fixed<4>(terms.data(), divisor, out, begin, end);
    default: return sum_range<float>(terms, divisor, out, begin, end);
  }
}

// float32 takes the written-out loops, the other types the general one
bool sum_any(const std::vector<const float*>& terms, float divisor, float* out, int64_t begin,
             int64_t end) {
  return sum_range_float(terms, divisor, out, begin, end);
}

template <typename T>
bool sum_any(const std::vector<const T*>& terms, float divisor, T* out, int64_t begin,
             int64_t end) {
  return sum_range<T>(terms, divisor, out, begin, end);
}

// the sum over every thread's range of out: whether any element is not finite
template <typename T>
bool sum_into(at::TensorList terms, float divisor, at::Tensor& out) {
  std::vector<const T*> ptrs;
  for (const auto& term : terms) ptrs.push_back(term.const_data_ptr<T>());
  T* o = out.data_ptr<T>();
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, out.numel(), kGrainElements, [&](int64_t begin, int64_t end) {
    if (sum_any(ptrs, divisor, o, begin, end)) nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

at::Tensor node_sum_cpu(at::TensorList terms, double divisor, at::Tensor& out) {
  const char* op = "node_sum_into";
  TORCH_CHECK(terms.size() >= 1, op, ": needs at least one term");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor");
  TORCH_CHECK(divisor > 0 && std::isfinite(divisor), op, ": divisor must be positive, got ",
              divisor);
  const auto dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": out must be float32, float16 or bfloat16, got ", dtype);
  const int64_t numel = out.numel();
  for (size_t t = 0; t < terms.size(); ++t) {
    const auto& term = terms[t];
    TORCH_CHECK(term.dim() == 1 && term.is_contiguous() && term.numel() == numel, op, ": term ", t,
                " must be a contiguous 1-D tensor of ", numel, " elements, got ", term.sizes());
    TORCH_CHECK(term.scalar_type() == dtype, op, ": term ", t, " is ", term.scalar_type(),
                ", out is ", dtype);
    TORCH_CHECK(term.device() == out.device(), op, ": term ", t, " is on ", term.device(),
                ", out on ", out.device());
  }
  const float div = static_cast<float>(divisor);
  bool nonfinite;
  switch (dtype) {  // the three types checked above, no others (float64 would round via float32)
    case at::kFloat: nonfinite = sum_into<float>(terms, div, out); break;
    case at::kHalf: nonfinite = sum_into<at::Half>(terms, div, out); break;
    default: nonfinite = sum_into<at::BFloat16>(terms, div, out); break;
  }
  return at::full({1}, nonfinite ? 1.0f : 0.0f, out.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // terms: L tensors of one dtype and numel -> out = (sum in order) / divisor, and float32 [1]:
  // 1 where out holds an inf or NaN, else 0
  m.def("node_sum_into(Tensor[] terms, float divisor, Tensor(a!) out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) { m.impl("node_sum_into", &node_sum_cpu); }

}  // namespace ciuicflow
