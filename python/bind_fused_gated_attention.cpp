// Binding of Qwen3-Next's full-attention layer in one call (cb_kernels/fused_gated_attention.h);
// cb_kernels/ops/gated_attention.py owns every check. Pointers are Python ints
// (tensor.data_ptr(), 0 for none), sizes and floats one tuple each.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "bindings.h"
#include "cb_kernels/fused_gated_attention.h"

namespace py = pybind11;

namespace {
using Ptrs = std::array<uintptr_t, 22>;
using Sizes = std::array<int64_t, 17>;
using Floats = std::array<float, 5>;

cbk::GatedAttentionParams params(const Ptrs& ptr, const Sizes& size, const Floats& f, int dtype) {
  cbk::GatedAttentionParams p;
  p.x = cbk::as_ptr<void>(ptr[0]);
  p.pending = cbk::as_ptr<const void>(ptr[1]);
  p.in_norm_weight = cbk::as_ptr<const void>(ptr[2]);
  p.post_norm_weight = cbk::as_ptr<const void>(ptr[3]);
  p.q_norm_weight = cbk::as_ptr<const void>(ptr[4]);
  p.k_norm_weight = cbk::as_ptr<const void>(ptr[5]);
  p.qkv_packed = cbk::as_ptr<const void>(ptr[6]);
  p.qkv_bias = cbk::as_ptr<const float>(ptr[7]);
  p.o_packed = cbk::as_ptr<const void>(ptr[8]);
  p.o_bias = cbk::as_ptr<const float>(ptr[9]);
  p.cos = cbk::as_ptr<const void>(ptr[10]);
  p.sin = cbk::as_ptr<const void>(ptr[11]);
  p.gate_sigmoid = cbk::as_ptr<const void>(ptr[12]);
  p.sigmoid_table = cbk::as_ptr<const uint16_t>(ptr[13]);
  p.h_out = cbk::as_ptr<void>(ptr[14]);
  p.workspace = cbk::as_ptr<void>(ptr[15]);
  p.k_cache = cbk::as_ptr<void>(ptr[16]);
  p.v_cache = cbk::as_ptr<void>(ptr[17]);
  p.slot_mapping = cbk::as_ptr<const int64_t>(ptr[18]);
  p.block_tables = cbk::as_ptr<const int32_t>(ptr[19]);
  p.seq_lens = cbk::as_ptr<const int32_t>(ptr[20]);
  p.cu_seqlens_q = cbk::as_ptr<const int32_t>(ptr[21]);
  p.num_tokens = size[0];
  p.hidden = size[1];
  p.num_heads = size[2];
  p.num_kv_heads = size[3];
  p.head_dim = size[4];
  p.rotary_dim = size[5];
  p.num_seqs = size[6];
  p.max_blocks_per_seq = size[7];
  p.block_table_stride = size[8];
  p.num_blocks = size[9];
  p.block_size = size[10];
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = size[11 + i];
    p.v_stride[i] = size[14 + i];
  }
  p.in_norm_eps = f[0];
  p.post_norm_eps = f[1];
  p.q_norm_eps = f[2];
  p.k_norm_eps = f[3];
  p.scale = f[4];
  p.dtype = cbk::as_dtype(dtype);
  return p;
}

template <cbk::Status (*run)(const cbk::GatedAttentionParams&, cbk::Isa)>
void def_stage(py::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](const Ptrs& ptr, const Sizes& size, const Floats& f, const std::string& isa, int dtype) {
        const cbk::GatedAttentionParams p = params(ptr, size, f, dtype);
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
        return cbk::cpu::gated_attention_workspace_bytes(params({}, size, {}, dtype));
      },
      "Workspace bytes of gated_attention_block for these sizes.");
}
