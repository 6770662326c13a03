// Test-only stand-in for <cuda_fp16.h> (see cuda_runtime.h here): bit-exact conversions.
#pragma once
#include "cb_kernels/common.h"
#include "cuda_runtime.h"

struct __half {
  uint16_t bits;
};
struct __half2 {
  __half lo, hi;
};
inline float __half2float(__half h) { return cbk::fp16_to_float(h.bits); }
inline __half __float2half_rn(float f) { return {cbk::float_to_fp16(f)}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.lo), __half2float(h.hi)}; }
