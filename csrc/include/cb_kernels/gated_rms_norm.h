// The gated RMSNorm after a stateful layer's scan: Qwen3-Next / Qwen3.5's RMSNormGated (per value
// head: norm, weight, then times silu(z)) and the Mamba-2 mixers' MambaRMSNormGated (times
// silu(gate) first, then a norm per group, then the weight), one pass over the rows in place of
// transformers' dozen torch ops. Torch-free; fp32, or bf16 with fp32 math rounded where
// transformers' bf16 op chain rounds (csrc/cpu/gated_rms_norm.cpp says where).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// For every token t and group j < num_groups (elements i < group_size of each):
//   norm_before_gate: out = round(round(w * round(x * r(x))) * silu(gate))    (Qwen3-Next)
//   else:             h = x * silu(gate); out = round(w * round(h * r(h)))    (Mamba-2)
// with r(v) = 1 / sqrt(mean over the group of v^2 + eps) and w = weight[(j * group_size + i)
// % weight_len] (weight_len = group_size: one weight for every group; = num_groups *
// group_size: one per element). Gate element (t, j, i) sits at gate + t * gate_token_stride +
// (j / groups_per_block) * gate_block_stride + (j % groups_per_block) * group_size + i, so z
// can be read where the fused qkvz projection left it (blocks of groups_per_block value heads
// per key head) without a copy.
struct GatedRmsNormParams {
  const void* x = nullptr;          // [tokens, num_groups * group_size], rows x_stride apart
  const void* gate = nullptr;       // see above
  const void* weight = nullptr;     // [weight_len], packed
  void* out = nullptr;              // [tokens, num_groups * group_size], packed
  int64_t tokens = 0, num_groups = 0, group_size = 0, weight_len = 0;
  int64_t x_stride = 0, gate_token_stride = 0, gate_block_stride = 0, groups_per_block = 1;
  float eps = 0.0f;
  bool norm_before_gate = true;
  DType dtype = DType::kFloat32;
};

namespace cpu {
// Bodies: portable, avx512 (gated_delta_rule_isa picks; `isa` caps it, for tests).
Status gated_rms_norm(const GatedRmsNormParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
