// Fused per-row operations of a decoder layer on CPU (the engine's Llama-family forward):
// RMSNorm with an optional residual add, SiLU(gate) * up, and rotary embedding in place.
// Torch-free; rows may be strided, elements within a row packed. Every tensor of one call has
// the call's dtype: fp32, or bf16 (math in fp32, each of transformers' bf16 ops rounded where
// transformers rounds it, see csrc/cpu/elementwise.cpp). fp16 is not taken.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// If residual: x[r] += residual[r] first (x written back). Then
// out[r] = weight * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)).
struct RmsNormParams {
  void* x = nullptr;                // [rows, dim], rows x_stride apart
  const void* residual = nullptr;   // [rows, dim] (residual_stride) or nullptr
  const void* weight = nullptr;     // [dim]
  void* out = nullptr;              // [rows, dim], rows out_stride apart
  int64_t rows = 0, dim = 0;
  int64_t x_stride = 0, residual_stride = 0, out_stride = 0;  // elements
  float eps = 0.0f;
  DType dtype = DType::kFloat32;
};

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][dim + i].
struct SiluMulParams {
  const void* gate_up = nullptr;    // [rows, 2 * dim], rows in_stride apart
  void* out = nullptr;              // [rows, dim], rows out_stride apart
  int64_t rows = 0, dim = 0, in_stride = 0, out_stride = 0;
  DType dtype = DType::kFloat32;
};

// For each token t and head h of x [tokens, heads, head_dim] (in place):
// x = x * cos[t] + rotate_half(x) * sin[t], rotate_half(x) = cat(-x[half:], x[:half]).
struct RopeParams {
  void* x = nullptr;
  const void* cos = nullptr;        // [tokens, head_dim], packed
  const void* sin = nullptr;        // [tokens, head_dim], packed
  int64_t tokens = 0, heads = 0, head_dim = 0;  // head_dim even
  int64_t token_stride = 0, head_stride = 0;    // elements
  DType dtype = DType::kFloat32;
};

// rope(q), rope(k) in place, then k and v written into their cache slots: rope_ twice and write_kv
// in one pass (the fused forward's three calls per layer after the qkv projection). q and k are
// RopeParams over the same tokens and cos/sin; the rotated k is what reaches the cache.
struct RopeWriteKvParams {
  RopeParams q, k;
  const void* value = nullptr;       // [tokens, k.heads, k.head_dim], head_dim packed
  int64_t value_token_stride = 0, value_head_stride = 0;   // elements
  void* k_cache = nullptr;           // [num_blocks, block_size, k.heads, k.head_dim]
  void* v_cache = nullptr;           // same shape as k_cache
  int64_t k_cache_stride[3] = {0, 0, 0};   // elements between blocks, offsets, heads
  int64_t v_cache_stride[3] = {0, 0, 0};
  const int64_t* slot_mapping = nullptr;   // [tokens]; slots outside [0, num_slots) are skipped
  int64_t block_size = 0, num_slots = 0;
};

namespace cpu {
Status rope_write_kv(const RopeWriteKvParams& p, Isa isa = Isa::kAuto);
// Bodies: portable, avx2; silu_mul and every bf16 call also avx512_bf16 (see cb_kernels/isa.h).
Status rms_norm(const RmsNormParams& p, Isa isa = Isa::kAuto);
Status silu_mul(const SiluMulParams& p, Isa isa = Isa::kAuto);
Status rope(const RopeParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
