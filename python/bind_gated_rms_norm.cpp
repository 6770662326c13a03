// Binding of the stateful layers' gated RMSNorm; cb_kernels/ops/gated_rms_norm.py owns the checks.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "cb_kernels/gated_rms_norm.h"

namespace py = pybind11;

void bind_gated_rms_norm(py::module_& m) {
  m.def(
      "gated_rms_norm",
      [](uintptr_t x, uintptr_t gate, uintptr_t weight, uintptr_t out, int64_t tokens,
         int64_t num_groups, int64_t group_size, int64_t weight_len, int64_t x_stride,
         int64_t gate_token_stride, int64_t gate_block_stride, int64_t groups_per_block, float eps,
         bool norm_before_gate, const std::string& isa, int dtype) {
        cbk::GatedRmsNormParams p;
        p.x = cbk::as_ptr<const void>(x);
        p.gate = cbk::as_ptr<const void>(gate);
        p.weight = cbk::as_ptr<const void>(weight);
        p.out = cbk::as_ptr<void>(out);
        p.tokens = tokens;
        p.num_groups = num_groups;
        p.group_size = group_size;
        p.weight_len = weight_len;
        p.x_stride = x_stride;
        p.gate_token_stride = gate_token_stride;
        p.gate_block_stride = gate_block_stride;
        p.groups_per_block = groups_per_block;
        p.eps = eps;
        p.norm_before_gate = norm_before_gate;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::gated_rms_norm(p, body));
      },
      "The gated RMSNorm of a gated delta-net or Mamba-2 layer (strides in elements).");
}
