// The short causal depthwise conv1d with its state (the conv before Qwen3-Next's gated delta rule,
// Mamba-2's and LFM2's short convolutions), over a variable-length batch, the window kept in slots.
//
// Per row s and channel c, with the row's inputs preceded by the last width - 1 inputs of
// conv_state[slots[s], c] when has_state[s] (zeros otherwise):
//   out[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - width + 1 + w, c])
// act: none or SiLU. Afterwards conv_state[slots[s], c] holds the row's last state_len inputs in
// time order, the older ones from the old state (or zeros): transformers' LinearAttentionLayer
// window (state_len = the kernel width there).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

struct CausalConv1dParams {
  const void* x = nullptr;          // [num_tokens, channels], tokens x_stride apart, dtype
  const void* weight = nullptr;     // [channels, width], packed, dtype
  const void* bias = nullptr;       // [channels] dtype, or nullptr
  void* conv_state = nullptr;       // [num_slots, channels, state_len], packed, dtype
  void* out = nullptr;              // [num_tokens, channels], packed, dtype
  VarlenRows rows;                  // slots, cu_seqlens, has_state, num_seqs, num_slots
  int64_t channels = 0, width = 0, state_len = 0;
  int64_t x_stride = 0;             // elements between tokens
  bool silu = true;
  DType dtype = DType::kFloat32;    // fp32, or bf16 (fp32 sums; the conv rounded to bf16 before
                                    // the SiLU, as transformers' two bf16 ops)
};

namespace cpu {
// Bodies: portable, avx512 (the same C++ compiled for AVX-512), chosen as gated_delta_rule_isa.
Status causal_conv1d(const CausalConv1dParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
