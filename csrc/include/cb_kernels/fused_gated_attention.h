// Qwen3-Next's full-attention layer up to its MLP in one call (Qwen3NextDecoderLayer's first half
// with Qwen3NextAttention), on the existing kernels with no Python between them:
//   x += pending (the previous MLP's output, when given); h = offset_rms_norm(x)
//   qkv = h @ W_qkv^T, per token [q_and_gate (num_heads x [q (head_dim) | gate (head_dim)]) |
//                                 k (num_kv_heads x head_dim) | v (num_kv_heads x head_dim)]
//   q = offset_rms_norm(q) and k = offset_rms_norm(k), per head (weights [head_dim])
//   rope on the first rotary_dim dims of each q and k head (partial rotary)
//   k, v written into their cache slots; attn = paged_attention(q) (causal, scale, no window)
//   attn *= sigmoid(gate); x += attn @ W_o^T; h_out = offset_rms_norm(x)
// The kernels are the separate calls' own (offset_rms_norm.h, linear.h, elementwise.h' rope,
// cache_ops.h' write_kv, paged_attention.h), with the same arguments, so the results are the
// bits of runner/hybrid_layers.py's separate calls. sigmoid(gate) is not computed here: torch's
// sigmoid is what transformers (and the separate calls) use, and its fp32 result is not a
// formula C++ can repeat bit for bit. So the caller gives either the sigmoid of every bf16 value
// (a table torch filled, exact for bf16: a gate value is one of 65536) or, between the two halves
// of the call, sigmoid(gate) itself (fp32): gated_attention_qkv leaves qkv at workspace offset 0,
// the caller computes the gate's sigmoid from it, gated_attention_rest does the rest.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

struct GatedAttentionParams {
  void* x = nullptr;                      // [num_tokens, hidden], packed, updated in place
  const void* pending = nullptr;          // [num_tokens, hidden], packed, or nullptr
  const void* in_norm_weight = nullptr;   // [hidden] (the module's w; the norm scales by 1 + w)
  const void* post_norm_weight = nullptr; // [hidden]
  const void* q_norm_weight = nullptr;    // [head_dim]
  const void* k_norm_weight = nullptr;    // [head_dim]
  float in_norm_eps = 0.0f, post_norm_eps = 0.0f, q_norm_eps = 0.0f, k_norm_eps = 0.0f;
  const void* qkv_packed = nullptr;       // packed [(2 heads + 2 kv_heads) head_dim, hidden]
  const float* qkv_bias = nullptr;        // fp32 [that many rows] or nullptr
  const void* o_packed = nullptr;         // packed [hidden, num_heads head_dim]
  const float* o_bias = nullptr;          // fp32 [hidden] or nullptr
  const void* cos = nullptr;              // [num_tokens, rotary_dim], packed
  const void* sin = nullptr;              // [num_tokens, rotary_dim], packed
  // The gate's sigmoid, one of the two (gated_attention_rest reads the first that is set):
  const void* gate_sigmoid = nullptr;     // [num_tokens, num_heads head_dim], packed
  const uint16_t* sigmoid_table = nullptr;  // bf16 only: [65536], entry b = sigmoid(bf16 bits b)
  void* h_out = nullptr;                  // [num_tokens, hidden], packed: the post norm's output
  void* workspace = nullptr;              // gated_attention_workspace_bytes(*this) bytes

  // The layer's caches [num_blocks, block_size, num_kv_heads, head_dim], element strides of the
  // block, offset and head axes (head_dim packed).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0};
  // The step's attention metadata (ops.paged_attention / write_kv's vocabulary).
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; slots outside the pool are skipped
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq], block_table_stride
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0, max_blocks_per_seq = 0, block_table_stride = 0;
  int64_t num_blocks = 0, block_size = 0;

  int64_t num_tokens = 0, hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t rotary_dim = 0;                 // even, <= head_dim
  float scale = 1.0f;                     // attention's softmax scale
  DType dtype = DType::kFloat32;          // fp32 or bf16: every tensor but the biases
};

namespace cpu {
// `isa` caps the body of every kernel inside (each picks its own best below the cap), for tests.
int64_t gated_attention_workspace_bytes(const GatedAttentionParams& p);
// x += pending; qkv = in_proj(offset_rms_norm(x)) into the workspace, [num_tokens, qkv width]
// packed at offset 0.
Status gated_attention_qkv(const GatedAttentionParams& p, Isa isa = Isa::kAuto);
// The rest, from the workspace's qkv: needs gate_sigmoid or sigmoid_table.
Status gated_attention_rest(const GatedAttentionParams& p, Isa isa = Isa::kAuto);
// Both halves in one call: needs sigmoid_table (bf16).
Status gated_attention_block(const GatedAttentionParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
