// A Qwen3NextForCausalLM step's backbone in one call (cb_kernels/qwen3_next_stack.h says what it
// computes).
//
// Why: with each Qwen3-Next layer two C++ calls (its mixer up to the MLP, then its MLP), what
// stayed of a decode step's forward was Python around ~10 such calls: the embedding, the rotary
// table's rows, a wrapper a call (~15-25 pointers converted, a workspace and an output
// allocated, the norm weights and packed linears looked up through module attributes), the
// final norm and the sampled rows' selection: ~0.47 ms of a 16-row bf16 decode step on the
// bench's Qwen3-Next hd128 shape, serial at any thread count. Here the layers' parameters are
// resolved once (runner/hybrid_stack.py keeps them until a weight changes) and a step is one
// call with the token ids, the sampled rows, the varlen rows, cos/sin and the attention
// metadata. Measured (bench/bench_hybrid_step.py --layers --rounds 5, bf16, 16-row decode, Zen 4,
// 2 cores, load ~1, 2026-12-07): the forward's glue 0.48-0.51 -> 0.33-0.34 ms at 1 thread and
// 0.42-0.46 -> 0.29-0.35 ms at 2, the layer calls' own wrappers ~0.1 ms more; the decode step
// (best / median) 4.40 / 4.53 -> 4.17 / 4.21 ms at 1 thread, 2.88 / 2.91 -> 2.57 / 2.71 at 2.
//
// The layers are gated_delta_net_block, gated_attention_block and moe_block themselves, the final
// norm offset_rms_norm, each with the arguments the per-layer path gives it, so the bits are
// those of the calls apart; the embedding and the selection are copies. Built portable only: the
// copies are ~16 rows x hidden a decode step; the kernels inside dispatch to their own bodies.
#include "cb_kernels/qwen3_next_stack.h"

#include <algorithm>

#include "cb_kernels/offset_rms_norm.h"
#include "row_copy.h"

namespace cbk {
namespace cpu {
namespace {

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// The workspace of layer l's mixer call over n tokens (its attention over p.num_seqs sequences).
int64_t layer_workspace_bytes(const Qwen3NextStackParams& p, const Qwen3NextStackLayer& l,
                              int64_t n) {
  if (!l.linear) {
    GatedAttentionParams a = l.attention;
    a.num_tokens = n;
    a.num_seqs = p.num_seqs;
    return gated_attention_workspace_bytes(a);
  }
  // The block sizes its workspace by rows.num_tokens(): one row of n tokens stands for the
  // step's rows (the size depends on the count alone).
  const int32_t cu[2] = {0, static_cast<int32_t>(n)};
  GatedDeltaNetBlockParams b = l.gdn;
  b.mixer.rows.cu_seqlens = cu;
  b.mixer.rows.num_seqs = 1;
  return gated_delta_net_block_workspace_bytes(b);
}

Status check(const Qwen3NextStackParams& p) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  const DType dt = p.dtype;
  if (dt != DType::kFloat32 && dt != DType::kBFloat16)
    return Status::Error("qwen3_next_stack: dtype must be float32 or bfloat16");
  if (p.num_layers < 0 || p.hidden <= 0 || p.vocab <= 0 || p.num_sampled < 0)
    return Status::Error("qwen3_next_stack: need num_layers >= 0, hidden > 0, vocab > 0, "
                         "num_sampled >= 0");
  const int64_t n = p.rows.num_tokens();
  if ((p.num_layers > 0 && !p.layers) || !p.embed || !p.final_norm_weight || !p.workspace ||
      (n > 0 && !p.input_ids) || (p.num_sampled > 0 && (!p.logits_indices || !p.out)))
    return Status::Error("qwen3_next_stack: null pointer");
  for (int64_t t = 0; t < n; ++t)
    if (p.input_ids[t] < 0 || p.input_ids[t] >= p.vocab)
      return Status::Error("qwen3_next_stack: an input id outside [0, vocab)");
  for (int64_t j = 0; j < p.num_sampled; ++j)
    if (p.logits_indices[j] < 0 || p.logits_indices[j] >= n)
      return Status::Error("qwen3_next_stack: a logits index outside [0, num_tokens)");
  for (int64_t i = 0; i < p.num_layers; ++i) {
    const Qwen3NextStackLayer& l = p.layers[i];
    const bool same = l.linear ? l.gdn.hidden == p.hidden && l.gdn.mixer.dtype == dt
                               : l.attention.hidden == p.hidden && l.attention.dtype == dt;
    if (!same || l.mlp.hidden != p.hidden || l.mlp.dtype != dt)
      return Status::Error("qwen3_next_stack: a layer of another hidden size or dtype");
    if (!l.linear && n > 0 && (!p.cos || !p.sin || !p.slot_mapping || !p.block_tables ||
                               !p.seq_lens || !p.cu_seqlens_q))
      return Status::Error("qwen3_next_stack: an attention layer without cos, sin or the "
                           "attention metadata");
  }
  return Status::Ok();
}

}  // namespace

int64_t qwen3_next_stack_workspace_bytes(const Qwen3NextStackParams& p, int64_t num_tokens) {
  const int64_t es = dtype_size(p.dtype), row = p.hidden * es;
  int64_t layers = 0;
  for (int64_t i = 0; i < p.num_layers; ++i)
    layers = std::max(layers, layer_workspace_bytes(p, p.layers[i], num_tokens));
  // x, h, pending; the sampled rows of x and of pending; the largest mixer's workspace
  return 3 * align64(num_tokens * row) + 2 * align64(p.num_sampled * row) + layers;
}

Status qwen3_next_stack(const Qwen3NextStackParams& p, Isa isa) {
  if (const Status s = check(p); !s.ok()) return s;
  const int64_t n = p.rows.num_tokens(), hidden = p.hidden, es = dtype_size(p.dtype);
  if (n == 0) return Status::Ok();
  char* x = static_cast<char*>(p.workspace);
  char* h = x + align64(n * hidden * es);
  char* pending = h + align64(n * hidden * es);
  char* picked_x = pending + align64(n * hidden * es);
  char* picked_pending = picked_x + align64(p.num_sampled * hidden * es);
  char* layer_ws = picked_pending + align64(p.num_sampled * hidden * es);

  copy_rows(p.embed, p.input_ids, n, hidden, p.dtype, x, p.dtype);
  for (int64_t i = 0; i < p.num_layers; ++i) {
    const Qwen3NextStackLayer& l = p.layers[i];
    const void* in_pending = i > 0 ? pending : nullptr;
    if (l.linear) {
      GatedDeltaNetBlockParams b = l.gdn;
      b.x = x;
      b.pending = in_pending;
      b.h_out = h;
      b.workspace = layer_ws;
      b.mixer.rows = p.rows;
      b.mixer.rows.num_slots = l.gdn.mixer.rows.num_slots;
      if (const Status s = gated_delta_net_block(b, isa); !s.ok()) return s;
    } else {
      GatedAttentionParams a = l.attention;
      a.x = x;
      a.pending = in_pending;
      a.h_out = h;
      a.workspace = layer_ws;
      a.num_tokens = n;
      a.cos = p.cos;
      a.sin = p.sin;
      a.slot_mapping = p.slot_mapping;
      a.block_tables = p.block_tables;
      a.seq_lens = p.seq_lens;
      a.cu_seqlens_q = p.cu_seqlens_q;
      a.num_seqs = p.num_seqs;
      a.max_blocks_per_seq = p.max_blocks_per_seq;
      a.block_table_stride = p.block_table_stride;
      if (const Status s = gated_attention_block(a, isa); !s.ok()) return s;
    }
    MoeBlockParams m = l.mlp;
    m.x = h;
    m.y = pending;
    m.num_tokens = n;
    m.x_stride = m.y_stride = hidden;
    if (const Status s = moe_block(m, isa); !s.ok()) return s;
  }
  if (p.num_sampled == 0) return Status::Ok();
  copy_rows(x, p.logits_indices, p.num_sampled, hidden, p.dtype, picked_x, p.dtype);
  OffsetRmsNormParams r;                    // the engine's final norm: its best body (auto)
  r.x = picked_x;
  if (p.num_layers > 0) {
    copy_rows(pending, p.logits_indices, p.num_sampled, hidden, p.dtype, picked_pending,
              p.dtype);
    r.residual = picked_pending;
  }
  r.weight = p.final_norm_weight;
  r.out = p.out;
  r.rows = p.num_sampled, r.dim = hidden, r.x_stride = r.residual_stride = hidden;
  r.eps = p.final_norm_eps;
  r.dtype = p.dtype;
  return offset_rms_norm(r);
}

}  // namespace cpu
}  // namespace cbk
