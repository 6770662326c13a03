// Shared vocabulary of the torch-free kernel API: dtypes, status codes, and the half-precision
// conversions the CPU kernels use. Nothing here includes torch or Python headers.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

namespace cbk {

// Element type of q/out/K/V. The Python wrappers map torch dtypes onto these codes.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int64_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Kernels never abort the process: they return a Status, and the binding turns a non-empty
// message into a Python RuntimeError.
struct Status {
  const char* message = nullptr;  // nullptr: success; else a static string naming the problem
  bool ok() const { return message == nullptr; }
  static Status Ok() { return Status{}; }
  static Status Error(const char* m) { return Status{m}; }
};

// ---- half-precision <-> float, exact and portable (no F16C needed for correctness).
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (x < 0x38800000u) {  // fp16 subnormal or zero: units of 2^-24, nearest-even rounding
    float mag;
    std::memcpy(&mag, &x, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(mag * 16777216.0f)));
  }
  uint32_t r = x + 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent, round to nearest even
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace cbk
