// What the CPU kernels share: how finely they split work across threads, and how hot loops are
// compiled.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace ciuicflow {

constexpr int64_t kGrainElements = 1 << 16;  // below this, threads cost more than they save

// 8 floats (or int32s) in a GCC vector: the hot loops' unit of work.
typedef float Lanes __attribute__((vector_size(32)));
typedef int32_t IntLanes __attribute__((vector_size(32)));

// v = x[0..8) as float lanes: a copy from float32, a conversion from float16 or bfloat16 (written
// through a reference: a vector return value would change the ABI where AVX is off).
template <typename scalar_t>
__attribute__((always_inline)) inline void load_lanes(const scalar_t* x, Lanes& v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, x, sizeof v);
  } else {
    for (int k = 0; k < 8; ++k) v[k] = static_cast<float>(x[k]);
  }
}

}  // namespace ciuicflow

// Hot loops are compiled twice, for AVX2 and for baseline x86-64, and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CIUICFLOW_HOT __attribute__((target_clones("avx2", "default")))
#else
#define CIUICFLOW_HOT
#endif
