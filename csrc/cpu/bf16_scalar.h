// Branch-free bf16 <-> fp32 scalar helpers of the norm kernels (gated_rms_norm.cpp,
// offset_rms_norm.cpp, fused_hybrid.cpp), so their loops vectorise: the portable body's scalar
// float_to_bf16, with its NaN branch, cost ~3 ns an element (89 us for 16 x 512 bf16). load and
// round_to take the dtype at run time (fused_hybrid.cpp, moe_block.cpp); they give the bits of
// bf16_to_float / float_to_bf16.
// Include only from a csrc/cpu/*.cpp (built once per ISA body, cb_kernels/isa.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "cb_kernels/common.h"  // DType

namespace cbk {
namespace CBK_CPU_NS {
namespace {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
// Round to nearest even into the high 16 bits, NaN kept quiet (as float_to_bf16).
inline uint32_t rne(float f) {
  const uint32_t b = float_bits(f);
  const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  return (b & 0x7fffffffu) > 0x7f800000u ? (b | 0x400000u) & 0xffff0000u : r;
}
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bits_to_float(static_cast<uint32_t>(x) << 16); }
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = static_cast<uint16_t>(rne(x) >> 16); }

// Element i of base (float32 or bfloat16 by dt) as a float.
inline float load(const void* base, int64_t i, DType dt) {
  return dt == DType::kBFloat16 ? widen(static_cast<const uint16_t*>(base)[i])
                                : static_cast<const float*>(base)[i];
}
// x rounded to the dtype and back (torch's bf16 op rounds its fp32 result).
inline float round_to(float x, DType dt) {
  return dt == DType::kBFloat16 ? bits_to_float(rne(x)) : x;
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
