// The gated delta rule (Qwen3-Next / Qwen3.5's linear attention) over a variable-length batch,
// its recurrent state kept in slots and updated in place. One call runs every row of a step:
// decodes (one token after earlier ones) and prefills (from zero state or from the slot) mixed.
//
// Per row s, value head h (key head kh = h / (num_v_heads / num_k_heads)) and token t of the row,
// with S = state[slots[s], h] ([k_dim, v_dim], fp32), zeros first unless has_state[s]:
//   q' = l2norm(q[t, kh]) * scale,  k' = l2norm(k[t, kh])     (l2norm: x * rsqrt(sum x^2 + 1e-6))
//   S  = S * exp(g[t, h])
//   d  = (v[t, h] - k'^T S) * beta[t, h]                         [v_dim]
//   S  = S + k' d^T
//   out[t, h] = q'^T S                                           [v_dim]
// the recurrence of transformers' torch_recurrent_gated_delta_rule (its chunked prefill computes
// the same sums in another order). The final S goes back to state[slots[s], h].
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

struct GatedDeltaParams {
  const void* q = nullptr;          // [num_tokens, num_k_heads, k_dim], dtype
  const void* k = nullptr;          // [num_tokens, num_k_heads, k_dim], dtype
  const void* v = nullptr;          // [num_tokens, num_v_heads, v_dim], dtype
  const float* g = nullptr;         // [num_tokens, num_v_heads] log decay (<= 0), packed
  const float* beta = nullptr;      // [num_tokens, num_v_heads], packed
  float* state = nullptr;           // [num_slots, num_v_heads, k_dim, v_dim] fp32, packed
  void* out = nullptr;              // [num_tokens, num_v_heads, v_dim], dtype, packed
  VarlenRows rows;                  // slots, cu_seqlens, has_state, num_seqs, num_slots
  int64_t num_k_heads = 0, num_v_heads = 0, k_dim = 0, v_dim = 0;
  int64_t q_stride[2] = {0, 0};     // elements between tokens, heads (last dim packed)
  int64_t k_stride[2] = {0, 0};
  int64_t v_stride[2] = {0, 0};
  float scale = 1.0f;               // applied to q after its l2norm
  bool l2norm_qk = true;
  DType dtype = DType::kFloat32;    // of q, k, v, out: fp32 or bf16 (math and state in fp32)
};

namespace cpu {
// Bodies: portable, avx512 (the same C++ compiled for AVX-512; the v_dim tiles stay in zmm).
Status gated_delta_rule(const GatedDeltaParams& p, Isa isa = Isa::kAuto);
Isa gated_delta_rule_isa(Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
