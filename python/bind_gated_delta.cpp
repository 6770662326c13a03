// Binding of the gated delta rule; cb_kernels/ops/gated_delta_rule.py owns every check.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "bindings.h"
#include "cb_kernels/gated_delta.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

void bind_gated_delta(py::module_& m) {
  using Stride2 = std::array<int64_t, 2>;
  m.def(
      "gated_delta_rule",
      [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta, uintptr_t state, uintptr_t out,
         const cbk::VarlenRowsArg& rows, int64_t num_k_heads, int64_t num_v_heads, int64_t k_dim, int64_t v_dim, Stride2 q_stride,
         Stride2 k_stride, Stride2 v_stride, float scale, bool l2norm_qk, const std::string& isa, int dtype) {
        cbk::GatedDeltaParams p;
        p.q = cbk::as_ptr<const void>(q);
        p.k = cbk::as_ptr<const void>(k);
        p.v = cbk::as_ptr<const void>(v);
        p.g = cbk::as_ptr<const float>(g);
        p.beta = cbk::as_ptr<const float>(beta);
        p.state = cbk::as_ptr<float>(state);
        p.out = cbk::as_ptr<void>(out);
        p.rows = cbk::as_rows(rows);
        p.num_k_heads = num_k_heads;
        p.num_v_heads = num_v_heads;
        p.k_dim = k_dim;
        p.v_dim = v_dim;
        for (int i = 0; i < 2; ++i) {
          p.q_stride[i] = q_stride[i];
          p.k_stride[i] = k_stride[i];
          p.v_stride[i] = v_stride[i];
        }
        p.scale = scale;
        p.l2norm_qk = l2norm_qk;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::gated_delta_rule(p, body));
      },
      "The gated delta rule over a varlen batch, state slots updated in place (strides in elements).");
  m.def("gated_delta_rule_isa",
        [](const std::string& isa) { return std::string(cbk::cpu::isa_name(cbk::cpu::gated_delta_rule_isa(cbk::as_isa(isa)))); },
        py::arg("isa") = "auto", "The body gated_delta_rule runs under `isa`: 'avx512' or 'portable'.");
}
