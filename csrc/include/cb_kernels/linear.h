// fp32 linear layer on CPU on a weight packed once: y = x @ W^T (+ bias). Torch-free.
//
// Layout of a packed weight: output columns in panels of 32; panel p holds W[32p .. 32p+31, :]
// transposed, [K][32] floats (zeros past N), so one k step of a panel is two cache lines. Each
// y[m][n] is one fused multiply-add chain over k = 0..K-1 in order, then + bias: the result
// does not depend on M, on the other rows, on the thread count or on the ISA body.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

constexpr int64_t kLinearPanel = 32;

inline int64_t linear_packed_floats(int64_t n, int64_t k) {
  return (n + kLinearPanel - 1) / kLinearPanel * kLinearPanel * k;
}

struct LinearPackParams {
  const float* weight = nullptr;  // [n, k], rows weight_stride apart
  int64_t n = 0;
  int64_t k = 0;
  int64_t weight_stride = 0;
  float* packed = nullptr;        // [linear_packed_floats(n, k)]
};

struct LinearParams {
  const float* x = nullptr;       // [m, k], rows x_stride apart
  int64_t m = 0;
  int64_t k = 0;
  int64_t x_stride = 0;
  const float* packed = nullptr;  // a packed [n, k] weight
  int64_t n = 0;
  const float* bias = nullptr;    // optional [n]
  float* y = nullptr;             // [m, n], rows y_stride apart
  int64_t y_stride = 0;
};

namespace cpu {
Status linear_pack(const LinearPackParams& p);
// Bodies: portable, avx2, avx512 (see cb_kernels/isa.h); all give the same bits.
Status linear(const LinearParams& p, Isa isa = Isa::kAuto);
Isa linear_isa(Isa isa = Isa::kAuto);  // the body linear(p, isa) runs on this machine
}  // namespace cpu

}  // namespace cbk

// ---- bf16 weights and activations (csrc/cpu/linear_bf16.cpp).
//
// Layout of a packed bf16 weight: 32-column panels as above, k in pairs: panel p holds
// [ceil(K / 2)][32][2] bf16 (W[32p + c][2i], W[32p + c][2i + 1] side by side; zeros past N and
// K), the operand of AVX512-BF16's pair dot product. y[m][n] is fp32 over the k pairs in order:
// acc += w[2i + 1] x[2i + 1], then acc += w[2i] x[2i] (each product exact in fp32, each add
// rounded), then + bias (fp32), rounded to bf16 once. So a row's result does not depend on M,
// on the other rows or on the thread count.
namespace cbk {

inline int64_t linear_bf16_packed_elems(int64_t n, int64_t k) {
  return (n + kLinearPanel - 1) / kLinearPanel * kLinearPanel * ((k + 1) / 2 * 2);
}

struct LinearBf16PackParams {
  const uint16_t* weight = nullptr;  // [n, k] bf16, rows weight_stride apart
  int64_t n = 0;
  int64_t k = 0;
  int64_t weight_stride = 0;
  uint16_t* packed = nullptr;        // [linear_bf16_packed_elems(n, k)]
};

struct LinearBf16Params {
  const uint16_t* x = nullptr;       // [m, k] bf16, rows x_stride apart
  int64_t m = 0;
  int64_t k = 0;
  int64_t x_stride = 0;
  const uint16_t* packed = nullptr;  // a packed [n, k] bf16 weight
  int64_t n = 0;
  const float* bias = nullptr;       // optional [n], fp32
  uint16_t* y = nullptr;             // [m, n] bf16, rows y_stride apart
  int64_t y_stride = 0;
};

// LinearParams (T = float) or LinearBf16Params (T = uint16_t): the same fields over either
// element type (the bindings and the fused decoder fill both through these).
template <typename P, typename T>
P linear_params(const void* x, int64_t m, int64_t k, int64_t x_stride, const void* packed,
                int64_t n, const float* bias, void* y, int64_t y_stride) {
  P l;
  l.x = static_cast<const T*>(x);
  l.m = m;
  l.k = k;
  l.x_stride = x_stride;
  l.packed = static_cast<const T*>(packed);
  l.n = n;
  l.bias = bias;
  l.y = static_cast<T*>(y);
  l.y_stride = y_stride;
  return l;
}

// LinearPackParams (T = float) or LinearBf16PackParams (T = uint16_t).
template <typename P, typename T>
P linear_pack_params(const void* weight, int64_t n, int64_t k, int64_t weight_stride, void* packed) {
  P l;
  l.weight = static_cast<const T*>(weight);
  l.n = n;
  l.k = k;
  l.weight_stride = weight_stride;
  l.packed = static_cast<T*>(packed);
  return l;
}

namespace cpu {
Status linear_bf16_pack(const LinearBf16PackParams& p);
// Bodies: portable, avx512_bf16 (vdpbf16ps; see cb_kernels/isa.h).
Status linear_bf16(const LinearBf16Params& p, Isa isa = Isa::kAuto);
Isa linear_bf16_isa(Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
