// What the CPU kernels share: how finely they split work across threads, and how hot loops are
// compiled.
#pragma once
#include <cstdint>

namespace ciuicflow {

constexpr int64_t kGrainElements = 1 << 16;  // below this, threads cost more than they save

}  // namespace ciuicflow

// Hot loops are compiled twice, for AVX2 and for baseline x86-64, and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CIUICFLOW_HOT __attribute__((target_clones("avx2", "default")))
#else
#define CIUICFLOW_HOT
#endif
