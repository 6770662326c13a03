// A whole MoE block, or a dense gated MLP, in one call (csrc/cpu/moe_block.cpp). Torch-free.
//
// With a router (Qwen3-Next's Qwen3NextSparseMoeBlock, Qwen2-MoE's block; Qwen3-MoE's without
// a shared expert), for every token t of x:
//   logits = x W_router^T                          (rounded to the dtype)
//   (w, ids) = moe_route(logits, top_k, renormalize)          (cb_kernels/moe_route.h)
//   routed = moe_experts(x, ids, w)                           (cb_kernels/moe.h)
//   shared = down(silu(x W_gate^T) * (x W_up^T))              (the shared expert, if any)
//   y = routed + round(shared * round(sigmoid(x W_shared_gate^T)))   (no gate: routed + shared)
// each op rounded to the dtype where torch rounds it (fp32: no rounding). sigmoid(g) is
// 1 / (1 + exp(-g)) in fp32 with libm's expf: torch's scalar loop, which its sigmoid runs on a
// contiguous [rows, 1] tensor of fewer than two SIMD vectors of rows (runner/hybrid_layers.py
// keeps larger steps on the separate calls for that reason). Without a router (Qwen3NextMLP)
// y = shared. Every linear is a packed one (cb_kernels/linear.h) with an optional fp32 bias;
// each stage is the same kernel call the engine made apart, so y has the same bits as the
// separate calls, whatever the thread count. Each kernel forks and joins its own threads: one
// team for the block (the router, route and gate beside the shared gate_up's panels, the down's
// panels beside the experts) measured no faster at two threads (moe_block.cpp says by how much).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

struct MoeBlockParams {
  DType dtype = DType::kFloat32;   // x, y and every packed weight: kFloat32 or kBFloat16
  const void* x = nullptr;         // [num_tokens, hidden], rows x_stride apart
  int64_t num_tokens = 0, hidden = 0, x_stride = 0;
  void* y = nullptr;               // [num_tokens, hidden], rows y_stride apart
  int64_t y_stride = 0;

  // The shared expert (the whole MLP when there is no router); nullptr: none.
  const void* shared_gate_up = nullptr;    // packed [2 * shared_inter, hidden]: gate rows, up rows
  const float* shared_gate_up_bias = nullptr;
  const void* shared_down = nullptr;       // packed [hidden, shared_inter]
  const float* shared_down_bias = nullptr;
  int64_t shared_inter = 0;
  const void* shared_gate = nullptr;       // packed [1, hidden], or nullptr: no sigmoid gate
  const float* shared_gate_bias = nullptr;

  // The router and the routed experts; router nullptr: a dense MLP.
  const void* router = nullptr;            // packed [num_experts, hidden]
  const float* router_bias = nullptr;
  int64_t num_experts = 0, top_k = 0;
  bool renormalize = true;
  const void* experts_gate_up = nullptr;   // MoeExpertsParams' packed weights (cb_kernels/moe.h)
  int64_t experts_gate_up_stride = 0;
  const void* experts_down = nullptr;
  int64_t experts_down_stride = 0;
  int64_t experts_inter = 0;

};

namespace cpu {
// `isa` caps the bodies of every kernel inside (tests force the portable ones). The work buffers
// it keeps between calls (the router's logits and top-k, the shared expert's activations) count
// in moe_workspace_bytes() and go with moe_release_workspaces() (cb_kernels/moe.h).
Status moe_block(const MoeBlockParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
