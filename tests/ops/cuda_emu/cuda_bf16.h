// Test-only stand-in for <cuda_bf16.h> (see cuda_runtime.h here): bit-exact conversions.
#pragma once
#include "cb_kernels/common.h"
#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 lo, hi;
};
inline float __bfloat162float(__nv_bfloat16 h) { return cbk::bf16_to_float(h.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {cbk::float_to_bf16(f)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.lo), __bfloat162float(h.hi)};
}
