// Paged attention, CPU: causal varlen queries (prefill, chunked prefill and decode in one call)
// over a KV cache read in place through int32 block tables. Torch-free: raw pointers, sizes and
// element strides; cb_kernels/ops/paged_attention/ checks every value before calling.
#pragma once

#include <cstdint>
#include <string>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// The parameters of both paged attention kernels: cbk::cpu::paged_attention (every q_len) and
// cbk::cuda::paged_attention_decode (q_len == 1 rows, see paged_attention_cuda.h). Sizes and
// element strides use the vocabulary of cb_kernels.ops.paged_attention; the innermost head_dim
// axis has stride 1 everywhere.
struct PagedAttentionParams {
  const void* q = nullptr;                // [num_tokens, num_heads, head_dim], dtype
  const void* k_cache = nullptr;          // [num_blocks, block_size, num_kv_heads, head_dim], dtype
  const void* v_cache = nullptr;          // same shape as k_cache (own strides)
  void* out = nullptr;                    // [num_tokens, num_heads, head_dim], dtype
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq], rows block_table_stride apart
  const int32_t* seq_lens = nullptr;      // [num_seqs], KV length including the new tokens
  const int32_t* cu_seqlens_q = nullptr;  // [num_seqs + 1]; q tokens of seq i are its last positions
  // CUDA only: fp32 workspace of the split partials, unused when max_splits == 1.
  float* part_out = nullptr;  // [num_seqs, num_heads, max_splits, head_dim]
  float* part_ml = nullptr;   // [num_seqs, num_heads, max_splits, 2]: running max and sum

  int64_t num_seqs = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;

  int64_t q_stride_token = 0, q_stride_head = 0;
  int64_t out_stride_token = 0, out_stride_head = 0;
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_token = 0, v_stride_head = 0;
  int64_t block_table_stride = 0;

  int64_t max_splits = 1;      // CUDA only: grid bound, decode_max_splits(longest span possible)
  DType dtype = DType::kFloat32;
  float scale = 1.0f;          // applied to q.k before softcap
  int32_t sliding_window = 0;  // W > 0: a query at p sees p-W+1 .. p; 0: off
  float softcap = 0.0f;        // c > 0: scores become c * tanh(scores / c); 0: off
  // CUDA only: num_tokens == num_seqs and no other launch covers q_len > 1 rows, so the decode
  // kernel computes them too.
  bool all_decode = false;

  // Read by paged_attention_index_error and the CPU kernel; the CUDA kernel needs none of them.
  int64_t num_tokens = 0, num_blocks = 0, max_blocks_per_seq = 0;

  // [num_heads] fp32: one extra logit per q head in every softmax (after scale and softcap)
  // whose value row is zero (attention sinks, gpt-oss); null: off. Last, so that mirrors of the
  // fields above (the CUDA emulation test) keep their layout.
  const float* sinks = nullptr;
};

// Checks the index values a kernel trusts: cu_seqlens_q runs from 0 to num_tokens without going
// down, no sequence has more q tokens than seq_len, ceil(seq_len / block_size) block ids fit the
// table row and lie in [0, num_blocks). Returns "" or a message naming the argument. Host memory
// only (~1 us for 64 sequences; the same checks in numpy took ~60 us).
inline std::string paged_attention_index_error(const PagedAttentionParams& p) {
  auto str = [](int64_t v) { return std::to_string(v); };
  const int32_t* cu = p.cu_seqlens_q;
  if (cu[0] != 0 || cu[p.num_seqs] != p.num_tokens)
    return "cu_seqlens_q must start at 0 and end at num_tokens=" + str(p.num_tokens) + ", got " +
           str(cu[0]) + " .. " + str(cu[p.num_seqs]);
  for (int64_t i = 0; i < p.num_seqs; ++i) {
    const int64_t q_len = int64_t{cu[i + 1]} - cu[i], seq_len = p.seq_lens[i];
    if (q_len < 0)
      return "cu_seqlens_q must be non-decreasing: cu_seqlens_q[" + str(i) + "]=" + str(cu[i]) +
             " > cu_seqlens_q[" + str(i + 1) + "]=" + str(cu[i + 1]);
    if (seq_len < 0) return "seq_lens[" + str(i) + "]=" + str(seq_len) + " is negative";
    if (q_len > seq_len)
      return "sequence " + str(i) + " has " + str(q_len) + " q tokens (cu_seqlens_q) but " +
             "seq_lens[" + str(i) + "]=" + str(seq_len) +
             ": q tokens must be the last positions of the sequence";
    if (seq_len > INT32_MAX - p.block_size)
      return "seq_lens[" + str(i) + "]=" + str(seq_len) + " must stay below 2**31 - block_size";
    const int64_t needed = (seq_len + p.block_size - 1) / p.block_size;
    if (needed > p.max_blocks_per_seq)
      return "seq_lens[" + str(i) + "]=" + str(seq_len) + " needs " + str(needed) + " blocks of " +
             str(p.block_size) + " but block_tables has only " + str(p.max_blocks_per_seq) +
             " columns";
    const int32_t* row = p.block_tables + i * p.block_table_stride;
    for (int64_t j = 0; j < needed; ++j)
      if (row[j] < 0 || row[j] >= p.num_blocks)
        return "block_tables[" + str(i) + ", " + str(j) + "]=" + str(row[j]) +
               " is outside the pool of " + str(p.num_blocks) + " blocks (k_cache.shape[0])";
  }
  return "";
}

namespace cpu {
// Bodies: portable, avx2 (see cb_kernels/isa.h).
Status paged_attention(const PagedAttentionParams& p, Isa isa = Isa::kAuto);
Isa paged_attention_isa(Isa isa = Isa::kAuto);  // the body paged_attention(p, isa) runs here
// The body bf16 K/V of this head_dim run on (avx512_bf16: vdpbf16ps, head_dim % 32 == 0).
Isa paged_attention_bf16_isa(int64_t head_dim, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
