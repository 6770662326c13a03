// The paged attention call of a fused layer (fused_decoder.cpp, fused_gated_attention.cpp), filled
// from the layer's params the same way in both. Private to csrc/cpu.
#pragma once

#include <cstdint>

#include "cb_kernels/paged_attention.h"

namespace cbk {
namespace cpu {

// A paged attention call over the layer's index tensors and caches: Layer is FusedDecoderParams
// or GatedAttentionParams, which name these fields alike (block_tables [num_seqs,
// max_blocks_per_seq], seq_lens [num_seqs], cu_seqlens_q [num_seqs + 1], the caches' element
// strides k_stride / v_stride [block, token, head], dtype, scale). q and out hold their heads
// packed (head stride head_dim); the caller sets q, out, their token strides and the caches.
template <typename Layer>
PagedAttentionParams layer_attention_params(const Layer& p, int64_t num_tokens,
                                            int64_t num_heads, int64_t num_kv_heads) {
  PagedAttentionParams a;
  a.block_tables = p.block_tables, a.block_table_stride = p.block_table_stride;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.seq_lens = p.seq_lens, a.cu_seqlens_q = p.cu_seqlens_q;
  a.num_tokens = num_tokens, a.num_seqs = p.num_seqs;
  a.num_heads = num_heads, a.num_kv_heads = num_kv_heads, a.head_dim = p.head_dim;
  a.num_blocks = p.num_blocks, a.block_size = p.block_size;
  a.q_stride_head = a.out_stride_head = p.head_dim;
  a.k_stride_block = p.k_stride[0];
  a.k_stride_token = p.k_stride[1];
  a.k_stride_head = p.k_stride[2];
  a.v_stride_block = p.v_stride[0];
  a.v_stride_token = p.v_stride[1];
  a.v_stride_head = p.v_stride[2];
  a.dtype = p.dtype;
  a.scale = p.scale;
  return a;
}

}  // namespace cpu
}  // namespace cbk
