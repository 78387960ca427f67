// An element of a gradient (float32, float16 or bfloat16, as ATen's scalar types) as float32.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ciuicflow {

template <typename scalar_t>
__device__ inline float to_float(scalar_t v) { return static_cast<float>(v); }
template <>
__device__ inline float to_float<c10::Half>(c10::Half v) { return __half2float(static_cast<__half>(v)); }
template <>
__device__ inline float to_float<c10::BFloat16>(c10::BFloat16 v) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&v));
}

}  // namespace ciuicflow
