// The Mamba-2 selective scan (SSD recurrence) over a variable-length batch, the state kept in
// slots and updated in place; one call runs every row of a step (decodes and prefills mixed).
//
// Per row s, head h (group gr = h / (num_heads / num_groups)) and token t of the row, with
// S = state[slots[s], h] ([head_dim, d_state], fp32), zeros first unless has_state[s]:
//   dt' = clamp(softplus?(dt[t, h] + dt_bias[h]), dt_min, dt_max)
//   S   = S * exp(dt' * A[h]) + dt' * x[t, h] B[t, gr]^T
//   out[t, h] = S C[t, gr] + D[h] * x[t, h]
// transformers' mamba2_selective_state_update per token (its chunked prefill computes the same
// sums in another order). softplus(v) = log1p(exp(v)), v itself above 20 (torch's threshold).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

struct SelectiveScanParams {
  const void* x = nullptr;          // [num_tokens, num_heads, head_dim], tokens x_stride apart
  const float* dt = nullptr;        // [num_tokens, num_heads], packed
  const float* A = nullptr;         // [num_heads]
  const void* B = nullptr;          // [num_tokens, num_groups, d_state], tokens bc_stride apart
  const void* C = nullptr;          // [num_tokens, num_groups, d_state], tokens bc_stride apart
  const float* D = nullptr;         // [num_heads] or nullptr
  const float* dt_bias = nullptr;   // [num_heads] or nullptr
  float* state = nullptr;           // [num_slots, num_heads, head_dim, d_state] fp32, packed
  void* out = nullptr;              // [num_tokens, num_heads, head_dim], packed
  VarlenRows rows;                  // slots, cu_seqlens, has_state, num_seqs, num_slots
  int64_t num_heads = 0, head_dim = 0, num_groups = 0, d_state = 0;
  int64_t x_stride = 0, b_stride = 0, c_stride = 0;   // elements between tokens
  bool dt_softplus = true;
  float dt_min = 0.0f, dt_max = 0.0f;   // dt_max <= dt_min: no clamp
  DType dtype = DType::kFloat32;    // of x, B, C, out: fp32 or bf16 (math and state fp32)
};

namespace cpu {
// Bodies: portable, avx512 (the same C++ compiled for AVX-512).
Status selective_scan(const SelectiveScanParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
