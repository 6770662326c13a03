// One call for the stateful middle of a hybrid layer: what sits between its input projection and
// its output projection, for every row of a step (decodes and prefills mixed), on the existing
// kernels (causal_conv1d, gated_delta_rule / selective_scan, gated_rms_norm) with no Python
// between them. ops/fused_hybrid.py and runner/hybrid_kernels.py call it; transformers' formulas
// are the ones cb_kernels/gated_delta.h, selective_scan.h and gated_rms_norm.h state.
//
// Gated delta-net (Qwen3-Next: in_proj_qkvz and in_proj_ba grouped by key head):
//   qkvz[t, kh] = [q (k_dim) | k (k_dim) | v (ratio * v_dim) | z (ratio * v_dim)],
//   ba[t, kh]   = [b (ratio) | a (ratio)]                    (ratio = num_v_heads / num_k_heads)
//   mixed = the q, k, v of every key head in the conv's channel order [q_all | k_all | v_all]
//   conv  = silu(causal_conv1d(mixed)) with the window in conv_state[slots]
//   beta[t, h] = sigmoid(b) rounded to the dtype, g[t, h] = softplus(a + dt_bias[h]) * neg_a[h]
//   core  = gated_delta_rule(q, k, v of conv, g, beta) on state[slots]
//   out   = gated_rms_norm(core, z) per value head (norm, weight, then times silu(z))
// Mamba-2 mixer (Mamba2, Bamba, Granite-MoE-hybrid, Nemotron-H):
//   proj[t] = [gate (inner) | xBC (conv_dim) | dt (num_heads)]
//   xBC' = silu(causal_conv1d(xBC)); y = selective_scan(x, dt (fp32), B, C of xBC')
//   out  = gated_rms_norm(y, gate) per group (times silu(gate) first, then the norm)
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

struct GatedDeltaNetParams {
  const void* qkvz = nullptr;        // [num_tokens, num_k_heads, 2 k_dim + 2 ratio v_dim], dtype,
                                     // tokens qkvz_stride apart, the rest packed
  const void* ba = nullptr;          // [num_tokens, num_k_heads, 2 ratio], tokens ba_stride apart
  const void* conv_weight = nullptr; // [conv_dim, conv_width], packed, dtype
  const void* conv_bias = nullptr;   // [conv_dim] dtype, or nullptr
  void* conv_state = nullptr;        // [num_slots, conv_dim, state_len], packed, dtype
  float* state = nullptr;            // [num_slots, num_v_heads, k_dim, v_dim] fp32, packed
  const void* dt_bias = nullptr;     // [num_v_heads], dtype
  const float* neg_a = nullptr;      // [num_v_heads] fp32: -exp(A_log)
  const void* norm_weight = nullptr; // [v_dim], dtype
  void* out = nullptr;               // [num_tokens, num_v_heads * v_dim], packed, dtype
  void* workspace = nullptr;         // gated_delta_net_workspace_bytes(*this) bytes
  VarlenRows rows;
  int64_t num_k_heads = 0, num_v_heads = 0, k_dim = 0, v_dim = 0;
  int64_t conv_width = 0, state_len = 0, qkvz_stride = 0, ba_stride = 0;
  float scale = 1.0f, norm_eps = 0.0f;
  DType dtype = DType::kFloat32;     // fp32 or bf16 (math and state fp32)
};

struct Mamba2MixerParams {
  const void* proj = nullptr;        // [num_tokens, inner + conv_dim + num_heads], dtype,
                                     // tokens proj_stride apart, the rest packed
  const void* conv_weight = nullptr; // [conv_dim, conv_width], packed, dtype
  const void* conv_bias = nullptr;   // [conv_dim] dtype, or nullptr
  void* conv_state = nullptr;        // [num_slots, conv_dim, state_len], packed, dtype
  float* state = nullptr;            // [num_slots, num_heads, head_dim, d_state] fp32, packed
  const float* A = nullptr;          // [num_heads] fp32: -exp(A_log)
  const float* D = nullptr;          // [num_heads] fp32
  const float* dt_bias = nullptr;    // [num_heads] fp32
  const void* norm_weight = nullptr; // [inner], dtype
  void* out = nullptr;               // [num_tokens, inner], packed, dtype
  void* workspace = nullptr;         // mamba2_mixer_workspace_bytes(*this) bytes
  VarlenRows rows;
  int64_t num_heads = 0, head_dim = 0, num_groups = 0, d_state = 0, norm_group_size = 0;
  int64_t conv_width = 0, state_len = 0, proj_stride = 0;
  float norm_eps = 0.0f;
  DType dtype = DType::kFloat32;
};

// A whole Mamba-2 block (Mamba2Block: the residual, the norm, in_proj, the mixer, out_proj):
//   h = rms_norm(x rounded to the dtype) (Llama's formula: weight * round(x * r));
//   x += out_proj(mixer(in_proj(h)))   (in x's dtype: fp32 with residual_in_fp32)
// on the packed linears (cb_kernels/linear.h), every step in C++ (runner/hybrid_layers.py).
// `isa` caps the mixer's kernels only: the norm and the linears run their best bodies, as the
// engine's separate calls do.
struct Mamba2BlockParams {
  void* x = nullptr;                 // [num_tokens, hidden], packed, x_dtype, updated in place
  DType x_dtype = DType::kFloat32;   // fp32 (residual_in_fp32) or the mixer's dtype
  const void* norm_weight = nullptr; // [hidden], the mixer's dtype
  float norm_eps = 0.0f;
  const void* in_packed = nullptr;   // in_proj packed ([inner + conv_dim + num_heads, hidden])
  const float* in_bias = nullptr;    // [in_proj rows] fp32, or nullptr
  const void* out_packed = nullptr;  // out_proj packed ([hidden, inner])
  const float* out_bias = nullptr;   // [hidden] fp32, or nullptr
  int64_t hidden = 0;
  Mamba2MixerParams mixer;           // its proj, out, workspace and proj_stride are set here
  void* workspace = nullptr;         // mamba2_block_workspace_bytes(*this) bytes
};

// A Qwen3-Next gated delta-net layer up to its MLP (Qwen3NextDecoderLayer's first half):
//   x += pending (the previous MLP's output, when given); h = offset_rms_norm(x);
//   x += out_proj(gated_delta_net(in_proj_qkvz(h), in_proj_ba(h))); h_out = offset_rms_norm(x)
// (offset_rms_norm: cb_kernels/offset_rms_norm.h, the residual adds rounded to the dtype).
// `isa` caps the mixer's kernels only, as Mamba2BlockParams'.
struct GatedDeltaNetBlockParams {
  void* x = nullptr;                 // [num_tokens, hidden], packed, dtype, updated in place
  const void* pending = nullptr;     // [num_tokens, hidden], packed, or nullptr
  const void* in_norm_weight = nullptr;    // [hidden]
  const void* post_norm_weight = nullptr;  // [hidden]
  float in_norm_eps = 0.0f, post_norm_eps = 0.0f;
  const void* qkvz_packed = nullptr; // packed in_proj_qkvz, in_proj_ba, out_proj (linear.h)
  const float* qkvz_bias = nullptr;
  const void* ba_packed = nullptr;
  const float* ba_bias = nullptr;
  const void* out_packed = nullptr;
  const float* out_bias = nullptr;
  int64_t hidden = 0;
  void* h_out = nullptr;             // [num_tokens, hidden], packed: the post-norm's output
  GatedDeltaNetParams mixer;         // its qkvz, ba, out, workspace and strides are set here
  void* workspace = nullptr;         // gated_delta_net_block_workspace_bytes(*this) bytes
};

// The whole backbone of a Mamba2ForCausalLM step up to its LM head (Mamba2Model):
//   x = embed[input_ids] (widened to x_dtype); every layer's mamba2_block on x in order;
//   out[j] = rms_norm(x[logits_indices[j]]) with final_norm_weight in x_dtype (Llama's formula),
//   rounded to the dtype (transformers' norm_f on the residual stream, then the cast for the
//   LM head). Only the sampled rows are normalised: the norm is per row, so the bits are those of
//   norming every row and selecting after.
struct Mamba2StackParams {
  const Mamba2BlockParams* layers = nullptr;  // [num_layers]: weights, sizes and mixers; their
                                              // x, x_dtype, rows and workspaces are set here
  int64_t num_layers = 0;
  const void* embed = nullptr;                // [vocab, hidden], packed, the dtype
  int64_t vocab = 0, hidden = 0;
  const int64_t* input_ids = nullptr;         // [num_tokens] (rows.num_tokens()), in [0, vocab)
  const int64_t* logits_indices = nullptr;    // [num_sampled], in [0, num_tokens)
  int64_t num_sampled = 0;
  const void* final_norm_weight = nullptr;    // [hidden], x_dtype
  float final_norm_eps = 0.0f;
  DType x_dtype = DType::kFloat32;            // the residual stream: fp32 or the dtype
  DType dtype = DType::kFloat32;              // the layers' (fp32 or bf16)
  VarlenRows rows;                            // the step's rows, packed-token order
  void* out = nullptr;                        // [num_sampled, hidden], packed, the dtype
  void* workspace = nullptr;                  // mamba2_stack_workspace_bytes(*this, n) bytes
};

namespace cpu {
// `isa` caps the bodies of the kernels inside (gated_delta_rule_isa picks: portable, avx512).
int64_t gated_delta_net_workspace_bytes(const GatedDeltaNetParams& p);
Status gated_delta_net(const GatedDeltaNetParams& p, Isa isa = Isa::kAuto);
int64_t mamba2_mixer_workspace_bytes(const Mamba2MixerParams& p);
int64_t mamba2_mixer_workspace_bytes(const Mamba2MixerParams& p, int64_t num_tokens);
Status mamba2_mixer(const Mamba2MixerParams& p, Isa isa = Isa::kAuto);
int64_t mamba2_block_workspace_bytes(const Mamba2BlockParams& p);
int64_t mamba2_block_workspace_bytes(const Mamba2BlockParams& p, int64_t num_tokens);
Status mamba2_block(const Mamba2BlockParams& p, Isa isa = Isa::kAuto);
int64_t mamba2_stack_workspace_bytes(const Mamba2StackParams& p, int64_t num_tokens);
Status mamba2_stack(const Mamba2StackParams& p, Isa isa = Isa::kAuto);
int64_t gated_delta_net_block_workspace_bytes(const GatedDeltaNetBlockParams& p);
Status gated_delta_net_block(const GatedDeltaNetBlockParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
