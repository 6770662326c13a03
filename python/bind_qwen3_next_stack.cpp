// Binding of a Qwen3-Next backbone in one call (cb_kernels/qwen3_next_stack.h);
// cb_kernels/ops/qwen3_next_stack.py owns every check. Each layer is given once, as the tuples
// the layer calls' own bindings take (layer_params_arg.h); a step passes what changes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>
#include <vector>

#include "bindings.h"
#include "cb_kernels/qwen3_next_stack.h"
#include "layer_params_arg.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

namespace {
// The layers' parameters resolved once (runner/hybrid_stack.py rebuilds this when a weight
// changes).
struct Qwen3NextStack {
  std::vector<cbk::Qwen3NextStackLayer> layers;
  cbk::Qwen3NextStackParams p;

  cbk::Qwen3NextStackParams at(int64_t num_sampled, int64_t num_seqs) const {
    cbk::Qwen3NextStackParams q = p;
    q.layers = layers.data();
    q.num_layers = static_cast<int64_t>(layers.size());
    q.num_sampled = num_sampled;
    q.num_seqs = num_seqs;
    return q;
  }
};

cbk::MoeBlockParams mlp_params(const Qwen3NextStack& s, const cbk::MoePtrs& ptr,
                               const cbk::MoeSizes& size, bool renormalize) {
  return cbk::moe_block_params(s.p.dtype == cbk::DType::kBFloat16, ptr, size, renormalize);
}
}  // namespace

void bind_qwen3_next_stack(py::module_& m) {
  py::class_<Qwen3NextStack>(m, "Qwen3NextStack",
                             "A Qwen3NextForCausalLM backbone: embedding, every layer and its "
                             "MLP, the final norm of the sampled rows "
                             "(cb_kernels/qwen3_next_stack.h).")
      .def(py::init([](uintptr_t embed, int64_t vocab, int64_t hidden, uintptr_t final_norm_weight,
                       float final_norm_eps, int dtype) {
             Qwen3NextStack s;
             s.p.embed = cbk::as_ptr<const void>(embed);
             s.p.vocab = vocab;
             s.p.hidden = hidden;
             s.p.final_norm_weight = cbk::as_ptr<const void>(final_norm_weight);
             s.p.final_norm_eps = final_norm_eps;
             s.p.dtype = cbk::as_dtype(dtype);
             return s;
           }),
           "embed [vocab, hidden]; final_norm_weight [hidden]; dtype: the layers' code.")
      .def(
          "add_delta_net",
          [](Qwen3NextStack& s, const cbk::Ptrs11& ptr, const cbk::Ptrs11& mixer_ptr,
             const cbk::Sizes8& size, const std::array<float, 4>& f, int64_t num_slots,
             const cbk::MoePtrs& mlp_ptr, const cbk::MoeSizes& mlp_size, bool renormalize) {
            cbk::Qwen3NextStackLayer l;
            l.linear = true;
            l.gdn = cbk::gdn_block_params(ptr, mixer_ptr, {}, size, s.p.hidden, f,
                                          static_cast<int>(s.p.dtype));
            l.gdn.mixer.rows.num_slots = num_slots;
            l.mlp = mlp_params(s, mlp_ptr, mlp_size, renormalize);
            s.layers.push_back(l);
          },
          "Append a gated delta-net layer (gated_delta_net_block's ptr, mixer_ptr, size, f; "
          "num_slots of its state pool) and its MLP (moe_block's ptrs and sizes, x / y / "
          "num_tokens / strides unused; renormalize).")
      .def(
          "add_attention",
          [](Qwen3NextStack& s, const cbk::AttentionPtrs& ptr, const cbk::AttentionSizes& size,
             const cbk::AttentionFloats& f, const cbk::MoePtrs& mlp_ptr,
             const cbk::MoeSizes& mlp_size, bool renormalize) {
            cbk::Qwen3NextStackLayer l;
            l.linear = false;
            l.attention = cbk::gated_attention_params(ptr, size, f, static_cast<int>(s.p.dtype));
            l.mlp = mlp_params(s, mlp_ptr, mlp_size, renormalize);
            s.layers.push_back(l);
          },
          "Append a full-attention layer (gated_attention_block's ptr, size, f; the per-step "
          "entries unused) and its MLP (as add_delta_net's).")
      .def(
          "workspace_bytes",
          [](const Qwen3NextStack& s, int64_t num_tokens, int64_t num_sampled, int64_t num_seqs) {
            return cbk::cpu::qwen3_next_stack_workspace_bytes(s.at(num_sampled, num_seqs),
                                                              num_tokens);
          },
          "Workspace bytes of a call over num_tokens tokens, num_sampled sampled rows and "
          "num_seqs attention sequences.")
      .def(
          "__call__",
          [](const Qwen3NextStack& s, uintptr_t input_ids, uintptr_t logits_indices,
             int64_t num_sampled, uintptr_t out, uintptr_t workspace,
             const cbk::VarlenRowsArg& rows, const std::array<uintptr_t, 6>& attention,
             const std::array<int64_t, 3>& attention_size, const std::string& isa) {
            cbk::Qwen3NextStackParams p = s.at(num_sampled, attention_size[0]);
            p.input_ids = cbk::as_ptr<const int64_t>(input_ids);
            p.logits_indices = cbk::as_ptr<const int64_t>(logits_indices);
            p.out = cbk::as_ptr<void>(out);
            p.workspace = cbk::as_ptr<void>(workspace);
            p.rows = cbk::as_rows(rows);
            cbk::unpack(p, attention, &cbk::Qwen3NextStackParams::cos,
                        &cbk::Qwen3NextStackParams::sin, &cbk::Qwen3NextStackParams::slot_mapping,
                        &cbk::Qwen3NextStackParams::block_tables,
                        &cbk::Qwen3NextStackParams::seq_lens,
                        &cbk::Qwen3NextStackParams::cu_seqlens_q);
            p.max_blocks_per_seq = attention_size[1];
            p.block_table_stride = attention_size[2];
            const cbk::Isa body = cbk::as_isa(isa);
            py::gil_scoped_release nogil;
            cbk::throw_if_error(cbk::cpu::qwen3_next_stack(p, body));
          },
          "One step: input_ids int64 [num_tokens], logits_indices int64 [num_sampled], out "
          "[num_sampled, hidden], workspace, rows (the step's varlen rows), attention (cos, sin, "
          "slot_mapping, block_tables, seq_lens, cu_seqlens_q), attention_size (num_seqs, "
          "max_blocks_per_seq, block_table_stride), isa.");
}
