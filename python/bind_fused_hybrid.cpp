// Binding of the hybrid layers' fused middle (cb_kernels/fused_hybrid.h); cb_kernels/ops/
// fused_hybrid.py owns every check. Pointers are Python ints (tensor.data_ptr(), 0 for none);
// sizes come as one tuple each, so a call converts ~15 arguments (~2 us), not a struct's fields.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "cb_kernels/fused_hybrid.h"
#include "layer_params_arg.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

namespace {
using cbk::gdn_block_params;
using cbk::gdn_params;
using cbk::Ptrs11;
using cbk::Sizes8;
using cbk::unpack;

cbk::Mamba2MixerParams mamba2_params(const Ptrs11& ptr, const cbk::VarlenRowsArg& rows,
                                     const Sizes8& size, float eps, int dtype) {
  using P = cbk::Mamba2MixerParams;
  P p;
  unpack(p, ptr, &P::proj, &P::conv_weight, &P::conv_bias, &P::conv_state, &P::state, &P::A,
         &P::D, &P::dt_bias, &P::norm_weight, &P::out, &P::workspace);
  unpack(p, size, &P::num_heads, &P::head_dim, &P::num_groups, &P::d_state,
         &P::norm_group_size, &P::conv_width, &P::state_len, &P::proj_stride);
  p.rows = cbk::as_rows(rows);
  p.norm_eps = eps;
  p.dtype = cbk::as_dtype(dtype);
  return p;
}
cbk::Mamba2BlockParams block_params(const std::array<uintptr_t, 7>& ptr, const Ptrs11& mixer_ptr,
                                    const cbk::VarlenRowsArg& rows, const Sizes8& size,
                                    int64_t hidden, float norm_eps, float gate_norm_eps,
                                    int x_dtype, int dtype) {
  using P = cbk::Mamba2BlockParams;
  P p;
  unpack(p, ptr, &P::x, &P::norm_weight, &P::in_packed, &P::in_bias, &P::out_packed,
         &P::out_bias, &P::workspace);
  p.x_dtype = cbk::as_dtype(x_dtype);
  p.norm_eps = norm_eps;
  p.hidden = hidden;
  p.mixer = mamba2_params(mixer_ptr, rows, size, gate_norm_eps, dtype);
  return p;
}
// One layer of Mamba2Stack: mamba2_block's ptr (x and workspace unused), mixer_ptr, size, norm
// eps, gated-norm eps.
using StackLayer = std::tuple<std::array<uintptr_t, 7>, Ptrs11, Sizes8, float, float>;

// The layers' parameters resolved once (runner/hybrid_layers.py rebuilds this when a weight
// changes); a call passes only what changes each step.
struct Mamba2Stack {
  std::vector<cbk::Mamba2BlockParams> layers;
  cbk::Mamba2StackParams p;

  cbk::Mamba2StackParams at(int64_t num_sampled) const {
    cbk::Mamba2StackParams q = p;
    q.layers = layers.data();
    q.num_layers = static_cast<int64_t>(layers.size());
    q.num_sampled = num_sampled;
    return q;
  }
};
}  // namespace

void bind_fused_hybrid(py::module_& m) {
  m.def(
      "gated_delta_net",
      [](const Ptrs11& ptr, const cbk::VarlenRowsArg& rows, const Sizes8& size,
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
      [](const cbk::VarlenRowsArg& rows, const Sizes8& size, int dtype) {
        return cbk::cpu::gated_delta_net_workspace_bytes(
            gdn_params({}, rows, size, 1.0f, 0.0f, dtype));
      },
      "Workspace bytes of gated_delta_net for these rows and sizes.");
  m.def(
      "mamba2_mixer",
      [](const Ptrs11& ptr, const cbk::VarlenRowsArg& rows, const Sizes8& size,
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
      [](const cbk::VarlenRowsArg& rows, const Sizes8& size, int dtype) {
        return cbk::cpu::mamba2_mixer_workspace_bytes(mamba2_params({}, rows, size, 0.0f, dtype));
      },
      "Workspace bytes of mamba2_mixer for these rows and sizes.");
  m.def(
      "mamba2_block",
      [](const std::array<uintptr_t, 7>& ptr, const Ptrs11& mixer_ptr,
         const cbk::VarlenRowsArg& rows, const Sizes8& size, int64_t hidden,
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
      [](const cbk::VarlenRowsArg& rows, const Sizes8& size, int64_t hidden,
         int dtype) {
        return cbk::cpu::mamba2_block_workspace_bytes(
            block_params({}, {}, rows, size, hidden, 0.0f, 0.0f, dtype, dtype));
      },
      "Workspace bytes of mamba2_block for these rows and sizes.");
  m.def(
      "gated_delta_net_block",
      [](const std::array<uintptr_t, 11>& ptr, const Ptrs11& mixer_ptr,
         const cbk::VarlenRowsArg& rows, const Sizes8& size, int64_t hidden,
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
      [](const cbk::VarlenRowsArg& rows, const Sizes8& size, int64_t hidden,
         int dtype) {
        return cbk::cpu::gated_delta_net_block_workspace_bytes(
            gdn_block_params({}, {}, rows, size, hidden, {0, 0, 1, 0}, dtype));
      },
      "Workspace bytes of gated_delta_net_block for these rows and sizes.");
  py::class_<Mamba2Stack>(m, "Mamba2Stack",
                         "A Mamba2ForCausalLM backbone: embedding, every block, the final norm "
                         "of the sampled rows (cb_kernels/fused_hybrid.h, Mamba2StackParams).")
      .def(py::init([](const std::vector<StackLayer>& layers, uintptr_t embed, int64_t vocab,
                       int64_t hidden, uintptr_t final_norm_weight, float final_norm_eps,
                       int x_dtype, int dtype) {
             Mamba2Stack s;
             for (const StackLayer& l : layers)
               s.layers.push_back(block_params(std::get<0>(l), std::get<1>(l), {}, std::get<2>(l),
                                               hidden, std::get<3>(l), std::get<4>(l), x_dtype,
                                               dtype));
             s.p.embed = cbk::as_ptr<const void>(embed);
             s.p.vocab = vocab;
             s.p.hidden = hidden;
             s.p.final_norm_weight = cbk::as_ptr<const void>(final_norm_weight);
             s.p.final_norm_eps = final_norm_eps;
             s.p.x_dtype = cbk::as_dtype(x_dtype);
             s.p.dtype = cbk::as_dtype(dtype);
             return s;
           }),
           "layers: per layer (mamba2_block's ptr, mixer_ptr, size, norm eps, gated-norm eps); "
           "embed [vocab, hidden]; final_norm_weight [hidden] of x_dtype.")
      .def(
          "workspace_bytes",
          [](const Mamba2Stack& s, int64_t num_tokens, int64_t num_sampled) {
            return cbk::cpu::mamba2_stack_workspace_bytes(s.at(num_sampled), num_tokens);
          },
          "Workspace bytes of a call over num_tokens tokens and num_sampled sampled rows.")
      .def(
          "__call__",
          [](const Mamba2Stack& s, uintptr_t input_ids, uintptr_t logits_indices,
             int64_t num_sampled, uintptr_t out, uintptr_t workspace,
             const cbk::VarlenRowsArg& rows, const std::string& isa) {
            cbk::Mamba2StackParams p = s.at(num_sampled);
            p.input_ids = cbk::as_ptr<const int64_t>(input_ids);
            p.logits_indices = cbk::as_ptr<const int64_t>(logits_indices);
            p.out = cbk::as_ptr<void>(out);
            p.workspace = cbk::as_ptr<void>(workspace);
            p.rows = cbk::as_rows(rows);
            const cbk::Isa body = cbk::as_isa(isa);
            py::gil_scoped_release nogil;
            cbk::throw_if_error(cbk::cpu::mamba2_stack(p, body));
          },
          "One step: input_ids int64 [num_tokens], logits_indices int64 [num_sampled], out "
          "[num_sampled, hidden], workspace, rows (the step's varlen rows), isa.");
}
