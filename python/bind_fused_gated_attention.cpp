// Binding of Qwen3-Next's full-attention layer in one call (cb_kernels/fused_gated_attention.h);
// cb_kernels/ops/gated_attention.py owns every check. Pointers are Python ints
// (tensor.data_ptr(), 0 for none), sizes and floats one tuple each.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "bindings.h"
#include "cb_kernels/fused_gated_attention.h"
#include "layer_params_arg.h"

namespace py = pybind11;

namespace {
using Ptrs = cbk::AttentionPtrs;
using Sizes = cbk::AttentionSizes;
using Floats = cbk::AttentionFloats;
using cbk::gated_attention_params;

template <cbk::Status (*run)(const cbk::GatedAttentionParams&, cbk::Isa)>
void def_stage(py::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](const Ptrs& ptr, const Sizes& size, const Floats& f, const std::string& isa, int dtype) {
        const cbk::GatedAttentionParams p = gated_attention_params(ptr, size, f, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(run(p, body));
      },
      doc);
}
}  // namespace

void bind_fused_gated_attention(py::module_& m) {
  def_stage<cbk::cpu::gated_attention_block>(
      m, "gated_attention_block",
      "Qwen3-Next's full-attention layer up to its MLP (ptr: x, pending, in-norm, post-norm, "
      "q-norm and k-norm weights, qkv packed, its bias, o packed, its bias, cos, sin, "
      "gate_sigmoid, sigmoid_table, h_out, workspace, k_cache, v_cache, slot_mapping, "
      "block_tables, seq_lens, cu_seqlens_q; size: num_tokens, hidden, num_heads, num_kv_heads, "
      "head_dim, rotary_dim, num_seqs, max_blocks_per_seq, block_table_stride, num_blocks, "
      "block_size, k strides x3, v strides x3; f: in-norm, post-norm, q-norm, k-norm eps, "
      "scale).");
  def_stage<cbk::cpu::gated_attention_qkv>(
      m, "gated_attention_qkv",
      "gated_attention_block's first half: x += pending, qkv into the workspace (offset 0).");
  def_stage<cbk::cpu::gated_attention_rest>(
      m, "gated_attention_rest",
      "gated_attention_block's second half, from the workspace's qkv (gate_sigmoid or "
      "sigmoid_table given).");
  m.def(
      "gated_attention_workspace_bytes",
      [](const Sizes& size, int dtype) {
        return cbk::cpu::gated_attention_workspace_bytes(gated_attention_params({}, size, {}, dtype));
      },
      "Workspace bytes of gated_attention_block for these sizes.");
}
