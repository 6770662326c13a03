// Binding of the hybrid layers' fused middle (cb_kernels/fused_hybrid.h); cb_kernels/ops/
// fused_hybrid.py owns every check. Pointers are Python ints (tensor.data_ptr(), 0 for none);
// sizes come as one tuple each, so a call converts ~15 arguments (~2 us), not a struct's fields.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "bindings.h"
#include "cb_kernels/fused_hybrid.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

namespace {
using Ptrs11 = std::array<uintptr_t, 11>;

cbk::GatedDeltaNetParams gdn_params(const Ptrs11& ptr, const cbk::VarlenRowsArg& rows,
                                    const std::array<int64_t, 8>& size, float scale, float eps,
                                    int dtype) {
  cbk::GatedDeltaNetParams p;
  p.qkvz = cbk::as_ptr<const void>(ptr[0]);
  p.ba = cbk::as_ptr<const void>(ptr[1]);
  p.conv_weight = cbk::as_ptr<const void>(ptr[2]);
  p.conv_bias = cbk::as_ptr<const void>(ptr[3]);
  p.conv_state = cbk::as_ptr<void>(ptr[4]);
  p.state = cbk::as_ptr<float>(ptr[5]);
  p.dt_bias = cbk::as_ptr<const void>(ptr[6]);
  p.neg_a = cbk::as_ptr<const float>(ptr[7]);
  p.norm_weight = cbk::as_ptr<const void>(ptr[8]);
  p.out = cbk::as_ptr<void>(ptr[9]);
  p.workspace = cbk::as_ptr<void>(ptr[10]);
  p.rows = cbk::as_rows(rows);
  p.num_k_heads = size[0];
  p.num_v_heads = size[1];
  p.k_dim = size[2];
  p.v_dim = size[3];
  p.conv_width = size[4];
  p.state_len = size[5];
  p.qkvz_stride = size[6];
  p.ba_stride = size[7];
  p.scale = scale;
  p.norm_eps = eps;
  p.dtype = cbk::as_dtype(dtype);
  return p;
}

cbk::Mamba2MixerParams mamba2_params(const Ptrs11& ptr, const cbk::VarlenRowsArg& rows,
                                     const std::array<int64_t, 8>& size, float eps, int dtype) {
  cbk::Mamba2MixerParams p;
  p.proj = cbk::as_ptr<const void>(ptr[0]);
  p.conv_weight = cbk::as_ptr<const void>(ptr[1]);
  p.conv_bias = cbk::as_ptr<const void>(ptr[2]);
  p.conv_state = cbk::as_ptr<void>(ptr[3]);
  p.state = cbk::as_ptr<float>(ptr[4]);
  p.A = cbk::as_ptr<const float>(ptr[5]);
  p.D = cbk::as_ptr<const float>(ptr[6]);
  p.dt_bias = cbk::as_ptr<const float>(ptr[7]);
  p.norm_weight = cbk::as_ptr<const void>(ptr[8]);
  p.out = cbk::as_ptr<void>(ptr[9]);
  p.workspace = cbk::as_ptr<void>(ptr[10]);
  p.rows = cbk::as_rows(rows);
  p.num_heads = size[0];
  p.head_dim = size[1];
  p.num_groups = size[2];
  p.d_state = size[3];
  p.norm_group_size = size[4];
  p.conv_width = size[5];
  p.state_len = size[6];
  p.proj_stride = size[7];
  p.norm_eps = eps;
  p.dtype = cbk::as_dtype(dtype);
  return p;
}
cbk::Mamba2BlockParams block_params(const std::array<uintptr_t, 7>& ptr, const Ptrs11& mixer_ptr,
                                    const cbk::VarlenRowsArg& rows,
                                    const std::array<int64_t, 8>& size, int64_t hidden,
                                    float norm_eps, float gate_norm_eps, int x_dtype, int dtype) {
  cbk::Mamba2BlockParams p;
  p.x = cbk::as_ptr<void>(ptr[0]);
  p.norm_weight = cbk::as_ptr<const void>(ptr[1]);
  p.in_packed = cbk::as_ptr<const void>(ptr[2]);
  p.in_bias = cbk::as_ptr<const float>(ptr[3]);
  p.out_packed = cbk::as_ptr<const void>(ptr[4]);
  p.out_bias = cbk::as_ptr<const float>(ptr[5]);
  p.workspace = cbk::as_ptr<void>(ptr[6]);
  p.x_dtype = cbk::as_dtype(x_dtype);
  p.norm_eps = norm_eps;
  p.hidden = hidden;
  p.mixer = mamba2_params(mixer_ptr, rows, size, gate_norm_eps, dtype);
  return p;
}
cbk::GatedDeltaNetBlockParams gdn_block_params(const std::array<uintptr_t, 11>& ptr,
                                               const Ptrs11& mixer_ptr,
                                               const cbk::VarlenRowsArg& rows,
                                               const std::array<int64_t, 8>& size, int64_t hidden,
                                               const std::array<float, 4>& f, int dtype) {
  cbk::GatedDeltaNetBlockParams p;
  p.x = cbk::as_ptr<void>(ptr[0]);
  p.pending = cbk::as_ptr<const void>(ptr[1]);
  p.in_norm_weight = cbk::as_ptr<const void>(ptr[2]);
  p.post_norm_weight = cbk::as_ptr<const void>(ptr[3]);
  p.qkvz_packed = cbk::as_ptr<const void>(ptr[4]);
  p.qkvz_bias = cbk::as_ptr<const float>(ptr[5]);
  p.ba_packed = cbk::as_ptr<const void>(ptr[6]);
  p.ba_bias = cbk::as_ptr<const float>(ptr[7]);
  p.out_packed = cbk::as_ptr<const void>(ptr[8]);
  p.out_bias = cbk::as_ptr<const float>(ptr[9]);
  p.h_out = cbk::as_ptr<void>(ptr[10]);
  p.hidden = hidden;
  p.in_norm_eps = f[0];
  p.post_norm_eps = f[1];
  p.mixer = gdn_params(mixer_ptr, rows, size, f[2], f[3], dtype);
  p.workspace = p.mixer.workspace;      // mixer_ptr[10]: the block's workspace
  return p;
}
}  // namespace

void bind_fused_hybrid(py::module_& m) {
  m.def(
      "gated_delta_net",
      [](const Ptrs11& ptr, const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size,
         float scale, float eps, const std::string& isa, int dtype) {
        const cbk::GatedDeltaNetParams p = gdn_params(ptr, rows, size, scale, eps, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::gated_delta_net(p, body));
      },
      "A gated delta-net layer between its projections (ptr: qkvz, ba, conv weight, conv bias, "
      "conv state, state, dt_bias, neg_a, norm weight, out, workspace; size: num_k_heads, "
      "num_v_heads, k_dim, v_dim, conv width, state_len, qkvz stride, ba stride).");
  m.def(
      "gated_delta_net_workspace_bytes",
      [](const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int dtype) {
        return cbk::cpu::gated_delta_net_workspace_bytes(
            gdn_params({}, rows, size, 1.0f, 0.0f, dtype));
      },
      "Workspace bytes of gated_delta_net for these rows and sizes.");
  m.def(
      "mamba2_mixer",
      [](const Ptrs11& ptr, const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size,
         float eps, const std::string& isa, int dtype) {
        const cbk::Mamba2MixerParams p = mamba2_params(ptr, rows, size, eps, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::mamba2_mixer(p, body));
      },
      "A Mamba-2 mixer between its projections (ptr: proj, conv weight, conv bias, conv state, "
      "state, A, D, dt_bias, norm weight, out, workspace; size: num_heads, head_dim, num_groups, "
      "d_state, norm group size, conv width, state_len, proj stride).");
  m.def(
      "mamba2_mixer_workspace_bytes",
      [](const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int dtype) {
        return cbk::cpu::mamba2_mixer_workspace_bytes(mamba2_params({}, rows, size, 0.0f, dtype));
      },
      "Workspace bytes of mamba2_mixer for these rows and sizes.");
  m.def(
      "mamba2_block",
      [](const std::array<uintptr_t, 7>& ptr, const Ptrs11& mixer_ptr,
         const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int64_t hidden,
         float norm_eps, float gate_norm_eps, const std::string& isa, int x_dtype, int dtype) {
        const cbk::Mamba2BlockParams p = block_params(ptr, mixer_ptr, rows, size, hidden, norm_eps,
                                                      gate_norm_eps, x_dtype, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::mamba2_block(p, body));
      },
      "A Mamba-2 block: x += out_proj(mixer(in_proj(rms_norm(x)))) (ptr: x, norm weight, "
      "in_proj packed, its bias, out_proj packed, its bias, workspace; mixer_ptr as "
      "mamba2_mixer's, its proj, out and workspace unused).");
  m.def(
      "mamba2_block_workspace_bytes",
      [](const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int64_t hidden,
         int dtype) {
        return cbk::cpu::mamba2_block_workspace_bytes(
            block_params({}, {}, rows, size, hidden, 0.0f, 0.0f, dtype, dtype));
      },
      "Workspace bytes of mamba2_block for these rows and sizes.");
  m.def(
      "gated_delta_net_block",
      [](const std::array<uintptr_t, 11>& ptr, const Ptrs11& mixer_ptr,
         const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int64_t hidden,
         const std::array<float, 4>& f, const std::string& isa, int dtype) {
        const cbk::GatedDeltaNetBlockParams p =
            gdn_block_params(ptr, mixer_ptr, rows, size, hidden, f, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::gated_delta_net_block(p, body));
      },
      "A Qwen3-Next gated delta-net layer up to its MLP (ptr: x, pending, in-norm weight, "
      "post-norm weight, qkvz packed, its bias, ba packed, its bias, out_proj packed, its bias, "
      "h_out; mixer_ptr as gated_delta_net's, qkvz / ba / out unused, the last the workspace; "
      "f: in-norm eps, post-norm eps, scale, gated-norm eps).");
  m.def(
      "gated_delta_net_block_workspace_bytes",
      [](const cbk::VarlenRowsArg& rows, const std::array<int64_t, 8>& size, int64_t hidden,
         int dtype) {
        return cbk::cpu::gated_delta_net_block_workspace_bytes(
            gdn_block_params({}, {}, rows, size, hidden, {0, 0, 1, 0}, dtype));
      },
      "Workspace bytes of gated_delta_net_block for these rows and sizes.");
}
