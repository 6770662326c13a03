// A Mamba2ForCausalLM step's backbone in one call (cb_kernels/fused_hybrid.h, Mamba2StackParams,
// says what it computes).
//
// Why: with each block one C++ call (mamba2_block), what stayed of a decode step's forward was
// Python around four such calls: the embedding, the cast of the residual stream to fp32, a
// wrapper a layer (its derived constants' version check, the varlen argument, a workspace
// allocation, ~15 pointers converted), the final norm on the fp32 stream, its cast and the
// sampled rows' selection, none of it scaling with threads. Here the layers' parameters are
// resolved once (runner/hybrid_stack.py keeps them until a weight changes) and a step is one
// call with the token ids, the sampled rows and the step's varlen rows: the forward's glue of a
// 16-row bf16 decode step on the bench's Mamba-2 ds128 shape from 0.32-0.40 to 0.18-0.23 ms
// (bench/bench_hybrid_step.py --blocks, Zen 4, 1 and 2 threads, load ~2).
//
// The blocks are mamba2_block itself and the final norm is rms_norm, so the bits are those of the
// calls apart; the embedding and the selection are copies. Built portable only: the copies are
// ~16 rows x hidden a decode step; the kernels inside dispatch to their own bodies.
#include <algorithm>

#include "cb_kernels/common.h"
#include "cb_kernels/elementwise.h"
#include "cb_kernels/fused_hybrid.h"
#include "row_copy.h"

namespace cbk {
namespace cpu {
namespace {

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

}  // namespace

int64_t mamba2_stack_workspace_bytes(const Mamba2StackParams& p, int64_t num_tokens) {
  const int64_t xs = dtype_size(p.x_dtype);
  int64_t blocks = 0;
  for (int64_t i = 0; i < p.num_layers; ++i)
    blocks = std::max(blocks, mamba2_block_workspace_bytes(p.layers[i], num_tokens));
  // x, the sampled rows, their norm (x_dtype), the largest block's workspace
  return align64(num_tokens * p.hidden * xs) + 2 * align64(p.num_sampled * p.hidden * xs) +
         blocks;
}

Status mamba2_stack(const Mamba2StackParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  const DType dt = p.dtype;
  if ((dt != DType::kFloat32 && dt != DType::kBFloat16) ||
      (p.x_dtype != DType::kFloat32 && p.x_dtype != dt))
    return Status::Error("mamba2_stack: dtype must be float32 or bfloat16, x_dtype float32 or "
                         "the dtype");
  if (p.num_layers < 0 || p.hidden <= 0 || p.vocab <= 0 || p.num_sampled < 0)
    return Status::Error("mamba2_stack: need num_layers >= 0, hidden > 0, vocab > 0, "
                         "num_sampled >= 0");
  const int64_t n = p.rows.num_tokens(), hidden = p.hidden;
  if (n == 0 && p.num_sampled == 0) return Status::Ok();
  if ((p.num_layers > 0 && !p.layers) || !p.embed || !p.final_norm_weight || !p.workspace ||
      (n > 0 && !p.input_ids) || (p.num_sampled > 0 && (!p.logits_indices || !p.out)))
    return Status::Error("mamba2_stack: null pointer");
  for (int64_t t = 0; t < n; ++t)
    if (p.input_ids[t] < 0 || p.input_ids[t] >= p.vocab)
      return Status::Error("mamba2_stack: an input id outside [0, vocab)");
  for (int64_t j = 0; j < p.num_sampled; ++j)
    if (p.logits_indices[j] < 0 || p.logits_indices[j] >= n)
      return Status::Error("mamba2_stack: a logits index outside [0, num_tokens)");
  for (int64_t i = 0; i < p.num_layers; ++i)
    if (p.layers[i].hidden != hidden || p.layers[i].mixer.dtype != dt)
      return Status::Error("mamba2_stack: a layer of another hidden size or dtype");

  const int64_t xs = dtype_size(p.x_dtype);
  char* x = static_cast<char*>(p.workspace);
  char* picked = x + align64(n * hidden * xs);
  char* normed = picked + align64(p.num_sampled * hidden * xs);
  char* block_ws = normed + align64(p.num_sampled * hidden * xs);

  copy_rows(p.embed, p.input_ids, n, hidden, dt, x, p.x_dtype);
  for (int64_t i = 0; i < p.num_layers; ++i) {
    Mamba2BlockParams b = p.layers[i];
    b.x = x;
    b.x_dtype = p.x_dtype;
    b.mixer.rows = p.rows;
    b.workspace = block_ws;
    if (const Status s = mamba2_block(b, isa); !s.ok()) return s;
  }
  if (p.num_sampled == 0) return Status::Ok();
  copy_rows(x, p.logits_indices, p.num_sampled, hidden, p.x_dtype, picked, p.x_dtype);
  RmsNormParams r;                           // the engine's norm: its best body (auto)
  r.x = picked;
  r.weight = p.final_norm_weight;
  r.out = p.x_dtype == dt ? p.out : normed;
  r.rows = p.num_sampled, r.dim = hidden, r.x_stride = r.out_stride = hidden;
  r.eps = p.final_norm_eps;
  r.dtype = p.x_dtype;
  if (const Status s = rms_norm(r); !s.ok()) return s;
  if (p.x_dtype != dt) copy_rows(normed, nullptr, p.num_sampled, hidden, p.x_dtype, p.out, dt);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace cbk
