// Fused per-row fp32 operations of a decoder layer on CPU (the engine's Llama-family forward):
// RMSNorm with an optional residual add, SiLU(gate) * up, and rotary embedding in place.
// Torch-free; rows may be strided, elements within a row packed.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// If residual: x[r] += residual[r] first (x written back). Then
// out[r] = weight * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)).
struct RmsNormParams {
  float* x = nullptr;               // [rows, dim], rows x_stride apart
  const float* residual = nullptr;  // [rows, dim] (residual_stride) or nullptr
  const float* weight = nullptr;    // [dim]
  float* out = nullptr;             // [rows, dim], rows out_stride apart
  int64_t rows = 0, dim = 0;
  int64_t x_stride = 0, residual_stride = 0, out_stride = 0;
  float eps = 0.0f;
};

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][dim + i].
struct SiluMulParams {
  const float* gate_up = nullptr;   // [rows, 2 * dim], rows in_stride apart
  float* out = nullptr;             // [rows, dim], rows out_stride apart
  int64_t rows = 0, dim = 0, in_stride = 0, out_stride = 0;
};

// For each token t and head h of x [tokens, heads, head_dim] (in place):
// x = x * cos[t] + rotate_half(x) * sin[t], rotate_half(x) = cat(-x[half:], x[:half]).
struct RopeParams {
  float* x = nullptr;
  const float* cos = nullptr;       // [tokens, head_dim], packed
  const float* sin = nullptr;       // [tokens, head_dim], packed
  int64_t tokens = 0, heads = 0, head_dim = 0;  // head_dim even
  int64_t token_stride = 0, head_stride = 0;    // elements
};

namespace cpu {
// Bodies: portable, avx2 (see cb_kernels/isa.h).
Status rms_norm(const RmsNormParams& p, Isa isa = Isa::kAuto);
Status silu_mul(const SiluMulParams& p, Isa isa = Isa::kAuto);
Status rope(const RopeParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
