// The routed experts of a mixture-of-experts layer in one call (csrc/cpu/moe_experts.cpp).
// Torch-free.
//
// For every (token, k) pair of the router's top-k: h = silu(x W_gate^T) * (x W_up^T), then
// d = h W_down^T, and y[token] = sum over k (in k order) of weight[token, k] * d. Each expert's
// gate_up ([2 * inter, hidden]: the inter gate rows, then the inter up rows) and down
// ([hidden, inter]) weights are packed like ops.PackedLinear's (cb_kernels/linear.h: fp32 panels
// or bf16 panels of k pairs), one packed weight after another. In bf16 every step rounds to bf16
// where transformers' experts forward does (the projections, silu, silu * up, d, weight * d) and
// the k sum is fp32, rounded once. A pair's result is one fixed chain of operations, so a
// token's output does not depend on the other tokens, the thread count or how pairs are split.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/linear.h"

namespace cbk {

struct MoeExpertsParams {
  DType dtype = DType::kFloat32;     // x, the packed weights and y: kFloat32 or kBFloat16
  const void* x = nullptr;           // [num_tokens, hidden], rows x_stride apart
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t x_stride = 0;
  const int64_t* topk_ids = nullptr;      // [num_tokens, top_k], each in [0, num_experts)
  const float* topk_weights = nullptr;    // [num_tokens, top_k]
  int64_t top_k = 0;
  int64_t num_experts = 0;
  int64_t inter = 0;                 // the experts' intermediate size
  const void* gate_up = nullptr;     // num_experts packed [2 * inter, hidden] weights
  int64_t gate_up_stride = 0;        // elements from one expert's packed gate_up to the next
  const void* down = nullptr;        // num_experts packed [hidden, inter] weights
  int64_t down_stride = 0;
  void* y = nullptr;                 // [num_tokens, hidden], rows y_stride apart
  int64_t y_stride = 0;
  // Optional, an MoE block's shared expert (cb_kernels/moe_block.h): y[token] = round(round(sum)
  // + round(add[token] * add_scale[token])) (no add_scale: round(round(sum) + add[token])).
  const void* add = nullptr;         // [num_tokens, hidden], rows add_stride apart, or nullptr
  int64_t add_stride = 0;
  const float* add_scale = nullptr;  // [num_tokens] (values of the dtype), or nullptr
};

// Elements of one expert's packed weight [n, k] of `dtype` (linear.h's layouts).
inline int64_t moe_packed_elems(DType dtype, int64_t n, int64_t k) {
  return dtype == DType::kBFloat16 ? linear_bf16_packed_elems(n, k) : linear_packed_floats(n, k);
}

namespace cpu {
// Bodies: fp32 portable / avx512 (FMA chains in k order: the same bits), bf16 portable /
// avx512_bf16 (vdpbf16ps pair products).
Status moe_experts(const MoeExpertsParams& p, Isa isa = Isa::kAuto);
Isa moe_experts_isa(DType dtype, Isa isa = Isa::kAuto);  // the body moe_experts(p, isa) runs here
// Bytes of the work buffers moe_experts keeps between calls (every thread's; not those of a
// call running now), and freeing them (returns the bytes freed): Engine.sleep(level=2).
int64_t moe_workspace_bytes();
int64_t moe_release_workspaces();
}  // namespace cpu

}  // namespace cbk
