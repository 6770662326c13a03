// The tuple arguments of the layer calls' bindings as their parameter structs: gated delta-net
// (bind_fused_hybrid.cpp), Qwen3-Next's attention layer (bind_fused_gated_attention.cpp), the
// MoE block (bind_moe.cpp); bind_qwen3_next_stack.cpp builds its layers from the same tuples.
// Pointers are Python ints (tensor.data_ptr(), 0 for none).
#pragma once

#include <array>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "bindings.h"
#include "cb_kernels/fused_gated_attention.h"
#include "cb_kernels/fused_hybrid.h"
#include "cb_kernels/moe_block.h"
#include "varlen_rows_arg.h"

namespace cbk {

using Ptrs11 = std::array<uintptr_t, 11>;
using Sizes8 = std::array<int64_t, 8>;
using AttentionPtrs = std::array<uintptr_t, 22>;
using AttentionSizes = std::array<int64_t, 17>;
using AttentionFloats = std::array<float, 5>;
using MoePtrs = std::array<uintptr_t, 12>;
using MoeSizes = std::array<int64_t, 10>;

// values[i] into p.*fields[i], in order: pointer fields from Python ints (data_ptr(), 0 for
// none), integer fields as they are.
template <class P, class Values, class... T>
void unpack(P& p, const Values& values, T P::*... fields) {
  static_assert(sizeof...(T) == std::tuple_size<Values>::value, "one value a field");
  size_t i = 0;
  auto set = [&](auto field) {
    using F = std::remove_reference_t<decltype(p.*field)>;
    if constexpr (std::is_pointer_v<F>)
      p.*field = reinterpret_cast<F>(values[i++]);
    else
      p.*field = static_cast<F>(values[i++]);
  };
  (set(fields), ...);
}

// ptr: qkvz, ba, conv weight, conv bias, conv state, state, dt_bias, neg_a, norm weight, out,
// workspace; size: num_k_heads, num_v_heads, k_dim, v_dim, conv width, state_len, qkvz stride,
// ba stride.
inline GatedDeltaNetParams gdn_params(const Ptrs11& ptr, const VarlenRowsArg& rows,
                                      const Sizes8& size, float scale, float eps, int dtype) {
  using P = GatedDeltaNetParams;
  P p;
  unpack(p, ptr, &P::qkvz, &P::ba, &P::conv_weight, &P::conv_bias, &P::conv_state, &P::state,
         &P::dt_bias, &P::neg_a, &P::norm_weight, &P::out, &P::workspace);
  unpack(p, size, &P::num_k_heads, &P::num_v_heads, &P::k_dim, &P::v_dim, &P::conv_width,
         &P::state_len, &P::qkvz_stride, &P::ba_stride);
  p.rows = as_rows(rows);
  p.scale = scale;
  p.norm_eps = eps;
  p.dtype = as_dtype(dtype);
  return p;
}

// ptr: x, pending, in-norm weight, post-norm weight, qkvz packed, its bias, ba packed, its bias,
// out_proj packed, its bias, h_out; mixer_ptr as gdn_params' (the last the block's workspace);
// f: in-norm eps, post-norm eps, scale, gated-norm eps.
inline GatedDeltaNetBlockParams gdn_block_params(const Ptrs11& ptr, const Ptrs11& mixer_ptr,
                                                 const VarlenRowsArg& rows, const Sizes8& size,
                                                 int64_t hidden, const std::array<float, 4>& f,
                                                 int dtype) {
  using P = GatedDeltaNetBlockParams;
  P p;
  unpack(p, ptr, &P::x, &P::pending, &P::in_norm_weight, &P::post_norm_weight, &P::qkvz_packed,
         &P::qkvz_bias, &P::ba_packed, &P::ba_bias, &P::out_packed, &P::out_bias, &P::h_out);
  p.hidden = hidden;
  p.in_norm_eps = f[0];
  p.post_norm_eps = f[1];
  p.mixer = gdn_params(mixer_ptr, rows, size, f[2], f[3], dtype);
  p.workspace = p.mixer.workspace;      // mixer_ptr[10]: the block's workspace
  return p;
}

// bind_fused_gated_attention.cpp's docstring lists the fields in order.
inline GatedAttentionParams gated_attention_params(const AttentionPtrs& ptr,
                                                   const AttentionSizes& size,
                                                   const AttentionFloats& f, int dtype) {
  using P = GatedAttentionParams;
  P p;
  unpack(p, std::array<uintptr_t, 16>{ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], ptr[5], ptr[6],
                                      ptr[7], ptr[8], ptr[9], ptr[10], ptr[11], ptr[12],
                                      ptr[13], ptr[14], ptr[15]},
         &P::x, &P::pending, &P::in_norm_weight, &P::post_norm_weight, &P::q_norm_weight,
         &P::k_norm_weight, &P::qkv_packed, &P::qkv_bias, &P::o_packed, &P::o_bias, &P::cos,
         &P::sin, &P::gate_sigmoid, &P::sigmoid_table, &P::h_out, &P::workspace);
  unpack(p, std::array<uintptr_t, 6>{ptr[16], ptr[17], ptr[18], ptr[19], ptr[20], ptr[21]},
         &P::k_cache, &P::v_cache, &P::slot_mapping, &P::block_tables, &P::seq_lens,
         &P::cu_seqlens_q);
  unpack(p, std::array<int64_t, 11>{size[0], size[1], size[2], size[3], size[4], size[5],
                                    size[6], size[7], size[8], size[9], size[10]},
         &P::num_tokens, &P::hidden, &P::num_heads, &P::num_kv_heads, &P::head_dim,
         &P::rotary_dim, &P::num_seqs, &P::max_blocks_per_seq, &P::block_table_stride,
         &P::num_blocks, &P::block_size);
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = size[11 + i];
    p.v_stride[i] = size[14 + i];
  }
  p.in_norm_eps = f[0];
  p.post_norm_eps = f[1];
  p.q_norm_eps = f[2];
  p.k_norm_eps = f[3];
  p.scale = f[4];
  p.dtype = as_dtype(dtype);
  return p;
}

// bind_moe.cpp's moe_block docstring lists the fields in order.
inline MoeBlockParams moe_block_params(bool bf16, const MoePtrs& ptr, const MoeSizes& size,
                                       bool renormalize) {
  using P = MoeBlockParams;
  P p;
  p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
  unpack(p, ptr, &P::x, &P::y, &P::shared_gate_up, &P::shared_gate_up_bias, &P::shared_down,
         &P::shared_down_bias, &P::shared_gate, &P::shared_gate_bias, &P::router,
         &P::router_bias, &P::experts_gate_up, &P::experts_down);
  unpack(p, size, &P::num_tokens, &P::hidden, &P::x_stride, &P::y_stride, &P::shared_inter,
         &P::num_experts, &P::top_k, &P::experts_gate_up_stride, &P::experts_down_stride,
         &P::experts_inter);
  p.renormalize = renormalize;
  return p;
}

}  // namespace cbk
