// Binding of the fused MoE experts and block; cb_kernels/ops/moe.py and moe_block.py own the
// checks. moe_block's pointers and sizes come as one tuple each (~2 us for the call's ~25
// arguments, as bind_fused_hybrid.cpp does).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "bindings.h"
#include "cb_kernels/moe.h"
#include "cb_kernels/moe_block.h"
#include "cb_kernels/moe_route.h"
#include "layer_params_arg.h"

namespace py = pybind11;

namespace {
cbk::DType moe_dtype(bool bf16) { return bf16 ? cbk::DType::kBFloat16 : cbk::DType::kFloat32; }
}  // namespace

void bind_moe(py::module_& m) {
  m.def("moe_packed_elems",
        [](bool bf16, int64_t n, int64_t k) { return cbk::moe_packed_elems(moe_dtype(bf16), n, k); },
        py::arg("bf16"), py::arg("n"), py::arg("k"),
        "Elements of one expert's packed [n, k] weight (fp32, or bf16 when bf16).");
  m.def("moe_experts_isa",
        [](bool bf16, const std::string& isa) {
          return std::string(cbk::cpu::isa_name(cbk::cpu::moe_experts_isa(moe_dtype(bf16),
                                                                          cbk::as_isa(isa))));
        },
        py::arg("bf16"), py::arg("isa") = "auto",
        "The body moe_experts runs here: fp32 'avx512' or 'portable', bf16 'avx512_bf16' or "
        "'portable'.");
  m.def(
      "moe_route",
      [](uintptr_t logits, int64_t num_tokens, int64_t num_experts, int64_t logits_stride,
         int64_t top_k, bool renormalize, int dtype, uintptr_t weights, uintptr_t ids) {
        cbk::MoeRouteParams p;
        p.logits = cbk::as_ptr<const void>(logits);
        p.num_tokens = num_tokens;
        p.num_experts = num_experts;
        p.logits_stride = logits_stride;
        p.top_k = top_k;
        p.renormalize = renormalize;
        p.dtype = cbk::as_dtype(dtype);
        p.weights = cbk::as_ptr<float>(weights);
        p.ids = cbk::as_ptr<int64_t>(ids);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::moe_route(p));
      },
      "An MoE top-k softmax router after its logits: fp32 weights and int64 expert ids.");
  m.def("moe_workspace_bytes", &cbk::cpu::moe_workspace_bytes,
        "Bytes of the work buffers moe_experts keeps between calls (all threads).");
  m.def("moe_release_workspaces", &cbk::cpu::moe_release_workspaces,
        "Free the work buffers moe_experts keeps between calls; returns the bytes freed.");
  m.def(
      "moe_experts",
      [](bool bf16, uintptr_t x, int64_t num_tokens, int64_t hidden, int64_t x_stride,
         uintptr_t topk_ids, uintptr_t topk_weights, int64_t top_k, int64_t num_experts,
         int64_t inter, uintptr_t gate_up, int64_t gate_up_stride, uintptr_t down,
         int64_t down_stride, uintptr_t y, int64_t y_stride, const std::string& isa) {
        cbk::MoeExpertsParams p;
        p.dtype = moe_dtype(bf16);
        p.x = cbk::as_ptr<const void>(x);
        p.num_tokens = num_tokens;
        p.hidden = hidden;
        p.x_stride = x_stride;
        p.topk_ids = cbk::as_ptr<const int64_t>(topk_ids);
        p.topk_weights = cbk::as_ptr<const float>(topk_weights);
        p.top_k = top_k;
        p.num_experts = num_experts;
        p.inter = inter;
        p.gate_up = cbk::as_ptr<const void>(gate_up);
        p.gate_up_stride = gate_up_stride;
        p.down = cbk::as_ptr<const void>(down);
        p.down_stride = down_stride;
        p.y = cbk::as_ptr<void>(y);
        p.y_stride = y_stride;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::moe_experts(p, body));
      },
      py::arg("bf16"), py::arg("x"), py::arg("num_tokens"), py::arg("hidden"), py::arg("x_stride"),
      py::arg("topk_ids"), py::arg("topk_weights"), py::arg("top_k"), py::arg("num_experts"),
      py::arg("inter"), py::arg("gate_up"), py::arg("gate_up_stride"), py::arg("down"),
      py::arg("down_stride"), py::arg("y"), py::arg("y_stride"), py::arg("isa") = "auto",
      "y[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, k], on "
      "packed expert weights (cb_kernels/moe.h).");
  m.def(
      "moe_block",
      [](bool bf16, const std::array<uintptr_t, 12>& ptr, const std::array<int64_t, 10>& size,
         bool renormalize, const std::string& isa) {
        const cbk::MoeBlockParams p = cbk::moe_block_params(bf16, ptr, size, renormalize);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::moe_block(p, body));
      },
      py::arg("bf16"), py::arg("ptrs"), py::arg("sizes"), py::arg("renormalize"),
      py::arg("isa") = "auto",
      "An MoE block (router, experts, shared expert and its sigmoid gate) or a dense gated MLP "
      "in one call (cb_kernels/moe_block.h). ptrs: x, y, shared gate_up, its bias, shared down, "
      "its bias, shared gate, its bias, router, its bias, experts gate_up, experts down (0: "
      "none); sizes: num_tokens, hidden, x_stride, y_stride, shared_inter, num_experts, top_k, "
      "experts gate_up stride, experts down stride, experts inter.");
}
