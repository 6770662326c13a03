// Paged attention, CPU: causal varlen queries (prefill, chunked prefill and decode in one call)
// over a KV cache read in place through int32 block tables. Torch-free: raw pointers, sizes and
// element strides; cb_kernels/ops/paged_attention.py checks every value before calling.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"

namespace cbk {

struct PagedAttentionParams {
  const void* q;                // [num_tokens, num_heads, head_dim], dtype
  const void* k_cache;          // [num_blocks, block_size, num_kv_heads, head_dim], dtype
  const void* v_cache;          // same shape as k_cache (own strides)
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], row stride block_table_stride
  const int32_t* seq_lens;      // [num_seqs], KV length including the new tokens
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]; q tokens of seq i are its last positions
  void* out;                    // [num_tokens, num_heads, head_dim], dtype

  int64_t num_tokens = 0, num_heads = 0, head_dim = 0;
  int64_t num_seqs = 0, max_blocks_per_seq = 0;
  int64_t num_blocks = 0, block_size = 0, num_kv_heads = 0;

  // Element strides (the innermost head_dim axis has stride 1 everywhere).
  int64_t q_stride_token = 0, q_stride_head = 0;
  int64_t out_stride_token = 0, out_stride_head = 0;
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_token = 0, v_stride_head = 0;
  int64_t block_table_stride = 0;

  DType dtype = DType::kFloat32;
  float scale = 1.0f;          // applied to q.k before softcap
  int32_t sliding_window = 0;  // W > 0: a query at p sees p-W+1 .. p; 0: off
  float softcap = 0.0f;        // c > 0: scores become c * tanh(scores / c); 0: off
};

namespace cpu {
// Best variant for this machine (see csrc/cpu/isa.h).
Status paged_attention(const PagedAttentionParams& p);
}  // namespace cpu

namespace cpu_generic {
// The portable variant, callable directly so tests cover it on AVX2 machines too.
Status paged_attention(const PagedAttentionParams& p);
}  // namespace cpu_generic

}  // namespace cbk
