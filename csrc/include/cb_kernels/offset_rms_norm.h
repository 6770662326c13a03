// The RMSNorm whose scale is (1 + weight), computed in fp32 and rounded once: Qwen3-Next's
// Qwen3NextRMSNorm (and Gemma's form), with the residual add before it in the same pass.
// Torch-free; fp32, or bf16 rows with fp32 math (csrc/cpu/offset_rms_norm.cpp says why).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// For every row t < rows (elements i < dim):
//   with a residual: x[t] = round(x[t] + residual[t])             (written back into x)
//   out[t, i] = round(float(x[t, i]) * r(x[t]) * (1 + float(weight[i])))
// with r(v) = 1 / sqrt(mean(float(v)^2) + eps) and round() to the dtype (identity in fp32):
// transformers' `(norm(x.float()) * (1.0 + w.float())).type_as(x)` after `residual + h`.
struct OffsetRmsNormParams {
  void* x = nullptr;                // [rows, dim], rows x_stride apart; written with a residual
  const void* residual = nullptr;   // [rows, dim], rows residual_stride apart, or null
  const void* weight = nullptr;     // [dim], packed, the dtype's
  void* out = nullptr;              // [rows, dim], packed
  int64_t rows = 0, dim = 0, x_stride = 0, residual_stride = 0;
  float eps = 0.0f;
  DType dtype = DType::kFloat32;
};

namespace cpu {
// Bodies: portable, avx512 (gated_delta_rule_isa picks; `isa` caps it, for tests).
Status offset_rms_norm(const OffsetRmsNormParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
