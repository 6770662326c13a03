// CUDA split-KV decode attention over a paged KV cache (torch-free API: raw pointers, element
// strides, a stream). Layouts are those of cb_kernels.ops.paged_attention:
//   q, out            [num_tokens, num_heads, head_dim]                  (unit last stride)
//   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]  (unit last stride)
//   block_tables      int32 [num_seqs, max_blocks_per_seq]
//   seq_lens          int32 [num_seqs]; cu_seqlens_q int32 [num_seqs + 1]
// The kernel computes the sequences with q_len == 1; the caller covers q_len > 1 sequences with
// another kernel (cb_kernels uses the Triton one), except when all_decode is set: then
// num_tokens == num_seqs and no other launch exists, so q_len > 1 sequences (possible only next to
// a q_len == 0 one) are computed here too, one token after another.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/paged_attention.h"

#if defined(__CUDACC__)
#define CBK_HOST_DEVICE __host__ __device__
#else
#define CBK_HOST_DEVICE
#endif

namespace cbk {
namespace cuda {

// Decode keys are cut into splits of at least kDecodeSplitMin keys, at most kDecodeMaxSplits per
// sequence. The count follows the sequence's own attended length only (never the batch), so its
// reduction order is the same whatever shares the batch.
// Keys per split are a multiple of kDecodeChunk (the keys one softmax step stages).
constexpr int64_t kDecodeSplitMin = 256;
constexpr int64_t kDecodeMaxSplits = 32;
constexpr int64_t kDecodeChunk = 64;

// Upper bound of the splits of any decode query attending at most `span` keys (the grid size:
// the exact count below is not monotone in span, this bound is).
CBK_HOST_DEVICE inline int64_t decode_max_splits(int64_t span) {
  const int64_t n = (span + kDecodeSplitMin - 1) / kDecodeSplitMin;
  return n < 1 ? 1 : (n > kDecodeMaxSplits ? kDecodeMaxSplits : n);
}

// Keys per split of one decode query that attends `span` keys.
CBK_HOST_DEVICE inline int64_t decode_split_len(int64_t span) {
  const int64_t n = decode_max_splits(span);
  const int64_t per = (span + n - 1) / n;
  const int64_t len = (per + kDecodeChunk - 1) / kDecodeChunk * kDecodeChunk;
  return len < kDecodeChunk ? kDecodeChunk : len;
}

// Splits of that query, none empty: at most decode_max_splits(span).
CBK_HOST_DEVICE inline int64_t decode_num_splits(int64_t span) {
  const int64_t len = decode_split_len(span);
  const int64_t n = (span + len - 1) / len;
  return n < 1 ? 1 : n;
}

// Launches the decode kernel (and the split reduce when max_splits > 1) on `stream` (a
// cudaStream_t); of `p` (cb_kernels/paged_attention.h) it reads neither num_tokens, num_blocks
// nor max_blocks_per_seq. Never synchronises; returns an error for unsupported shapes or a failed launch.
Status paged_attention_decode(const PagedAttentionParams& p, void* stream);

}  // namespace cuda
}  // namespace cbk
