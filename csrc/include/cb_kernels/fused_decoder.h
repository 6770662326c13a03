// The fused CPU decoder stack of a Llama-shaped model in one call: for every layer, RMSNorm (with
// the residual add), the packed qkv projection, rotary + K/V write, paged attention, the output
// projection, RMSNorm, the packed gate/up projection, SiLU * up and the down projection; then the
// final norm. It strings together the kernels of elementwise.h, linear.h and paged_attention.h
// with the arguments the Python loop of cb_kernels/runner/fused/forward.py gives them, in the same
// order, so its results are that loop's bit for bit; what it saves is that loop's per-call cost
// (nine calls a layer, each a Python wrapper, a pybind11 call and its tensor allocations).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"

namespace cbk {

struct FusedDecoderLayer {
  const void* in_norm = nullptr;      // [hidden], the dtype
  const void* post_norm = nullptr;    // [hidden]
  const void* qkv = nullptr;          // packed [(heads + 2 kv_heads) * head_dim, hidden] (linear.h)
  const void* o = nullptr;            // packed [hidden, heads * head_dim]
  const void* gate_up = nullptr;      // packed [2 * intermediate, hidden]: gate rows, then up rows
  const void* down = nullptr;         // packed [hidden, intermediate]
  const float* qkv_bias = nullptr;    // optional fp32 biases (as PackedLinear keeps them)
  const float* o_bias = nullptr;
  const float* gate_up_bias = nullptr;
  const float* down_bias = nullptr;
  void* k_cache = nullptr;            // [num_blocks, block_size, kv_heads, head_dim]
  void* v_cache = nullptr;
  int32_t sliding_window = 0;         // 0: off
};

struct FusedDecoderParams {
  const FusedDecoderLayer* layers = nullptr;
  int64_t num_layers = 0;
  DType dtype = DType::kFloat32;      // kFloat32 or kBFloat16: every tensor, weights included
  int64_t tokens = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 0.0f, scale = 1.0f;

  void* x = nullptr;                  // [tokens, hidden]: the embeddings in, the residual stream out
  void* out = nullptr;                // [tokens, hidden]: final_norm(x + last MLP output)
  const void* final_norm = nullptr;   // [hidden]
  // Scratch, each [tokens, width] packed: h (hidden), qkv ((heads + 2 kv_heads) * head_dim),
  // attn (heads * head_dim), sub (hidden), gate_up (2 * intermediate), act (intermediate).
  void *h = nullptr, *qkv = nullptr, *attn = nullptr, *sub = nullptr, *gate_up = nullptr,
       *act = nullptr;

  const void* cos = nullptr;          // [tokens, head_dim] packed, the dtype
  const void* sin = nullptr;
  const int64_t* slot_mapping = nullptr;   // [tokens]
  const int32_t* block_tables = nullptr;   // [num_seqs, max_blocks_per_seq], block_table_stride
  const int32_t* seq_lens = nullptr;       // [num_seqs]
  const int32_t* cu_seqlens_q = nullptr;   // [num_seqs + 1]
  int64_t num_seqs = 0, max_blocks_per_seq = 0, block_table_stride = 0;
  int64_t num_blocks = 0, block_size = 0;
  // Element strides shared by every layer's caches: block, offset, head.
  int64_t k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0};
};

namespace cpu {
Status fused_decoder(const FusedDecoderParams& p);
}  // namespace cpu

}  // namespace cbk
