// The backbone of a Qwen3NextForCausalLM step up to its LM head in one call (Qwen3NextModel),
// on the per-layer calls' own functions (csrc/cpu/qwen3_next_stack.cpp says why):
//   x = embed[input_ids]; pending = none
//   for each layer: h = gated_delta_net_block or gated_attention_block (x += pending in place,
//                   then the mixer's residual add, h the post norm's output);
//                   pending = moe_block(h)                (an MoE block or a dense MLP)
//   out[j] = offset_rms_norm(x[logits_indices[j]] + pending[logits_indices[j]])
// Only the sampled rows get the final norm: the norm and its residual add are per row, so the
// bits are those of norming every row and selecting after (runner/hybrid_layers.py's order).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/fused_gated_attention.h"
#include "cb_kernels/fused_hybrid.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/moe_block.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

// One decoder layer: its mixer up to the MLP (one of the two), then its MLP. The weights, sizes,
// state slots and caches are set once; what changes each step is set by qwen3_next_stack.
struct Qwen3NextStackLayer {
  bool linear = true;               // a gated delta-net layer (gdn), else full attention
  GatedDeltaNetBlockParams gdn;     // x, pending, h_out, workspace and mixer.rows (but its
                                    // num_slots: the layer's pool) set per step
  GatedAttentionParams attention;   // x, pending, h_out, workspace, cos, sin, num_tokens and
                                    // the attention metadata set per step; bf16 with
                                    // sigmoid_table (gated_attention_block's one call)
  MoeBlockParams mlp;               // x, y, num_tokens and the row strides set per step
};

struct Qwen3NextStackParams {
  const Qwen3NextStackLayer* layers = nullptr;  // [num_layers]
  int64_t num_layers = 0;
  const void* embed = nullptr;                  // [vocab, hidden], packed, the dtype
  int64_t vocab = 0, hidden = 0;
  const int64_t* input_ids = nullptr;           // [num_tokens] (rows.num_tokens()), in [0, vocab)
  const int64_t* logits_indices = nullptr;      // [num_sampled], in [0, num_tokens)
  int64_t num_sampled = 0;
  const void* final_norm_weight = nullptr;      // [hidden] (the norm scales by 1 + weight)
  float final_norm_eps = 0.0f;
  DType dtype = DType::kBFloat16;               // every layer's: fp32 or bf16
  VarlenRows rows;                              // the step's rows, packed-token order
  // The attention layers' per-step inputs (gated_attention_block's vocabulary).
  const void* cos = nullptr;                    // [num_tokens, rotary_dim], packed
  const void* sin = nullptr;                    // [num_tokens, rotary_dim], packed
  const int64_t* slot_mapping = nullptr;        // [num_tokens]
  const int32_t* block_tables = nullptr;        // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;            // [num_seqs]
  const int32_t* cu_seqlens_q = nullptr;        // [num_seqs + 1]
  int64_t num_seqs = 0, max_blocks_per_seq = 0, block_table_stride = 0;
  void* out = nullptr;                          // [num_sampled, hidden], packed, the dtype
  void* workspace = nullptr;                    // qwen3_next_stack_workspace_bytes(*this, n)
};

namespace cpu {
// Bytes of the call's one workspace for num_tokens tokens (num_sampled and num_seqs as set).
int64_t qwen3_next_stack_workspace_bytes(const Qwen3NextStackParams& p, int64_t num_tokens);
// `isa` caps the kernels inside as each layer call's own `isa` does.
Status qwen3_next_stack(const Qwen3NextStackParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
