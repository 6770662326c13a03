// An MoE top-k softmax router after its logits: transformers' Qwen3NextTopKRouter (shared by
// Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo): fp32 softmax over the experts, the top_k largest,
// optionally divided by their sum, rounded to the logits' dtype. Torch-free.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"

namespace cbk {

// For every token t: p = softmax(float(logits[t])) (exp(x - max) times 1 / their sum); ids[t]
// = the top_k experts by p, largest first, ties ordered as torch.topk orders them; w = p[ids],
// divided by their sum when `renormalize`; weights[t] = float(round(w)) with round() to the logits' dtype
// (identity in fp32): what the experts op then reads.
struct MoeRouteParams {
  const void* logits = nullptr;   // [num_tokens, num_experts], rows logits_stride apart
  int64_t num_tokens = 0, num_experts = 0, logits_stride = 0, top_k = 0;
  bool renormalize = true;
  DType dtype = DType::kFloat32;  // the logits'
  float* weights = nullptr;       // [num_tokens, top_k], packed
  int64_t* ids = nullptr;         // [num_tokens, top_k], packed
};

namespace cpu {
Status moe_route(const MoeRouteParams& p);
}  // namespace cpu

}  // namespace cbk
