// Binding of the Mamba-2 selective scan; cb_kernels/ops/selective_scan.py owns every check.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "cb_kernels/selective_scan.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

void bind_selective_scan(py::module_& m) {
  m.def(
      "selective_scan",
      [](uintptr_t x, uintptr_t dt, uintptr_t A, uintptr_t B, uintptr_t C, uintptr_t D, uintptr_t dt_bias,
         uintptr_t state, uintptr_t out, const cbk::VarlenRowsArg& rows, int64_t num_heads, int64_t head_dim, int64_t num_groups,
         int64_t d_state, int64_t x_stride, int64_t b_stride, int64_t c_stride, bool dt_softplus, float dt_min,
         float dt_max, const std::string& isa, int dtype) {
        cbk::SelectiveScanParams p;
        p.x = cbk::as_ptr<const void>(x);
        p.dt = cbk::as_ptr<const float>(dt);
        p.A = cbk::as_ptr<const float>(A);
        p.B = cbk::as_ptr<const void>(B);
        p.C = cbk::as_ptr<const void>(C);
        p.D = cbk::as_ptr<const float>(D);
        p.dt_bias = cbk::as_ptr<const float>(dt_bias);
        p.state = cbk::as_ptr<float>(state);
        p.out = cbk::as_ptr<void>(out);
        p.rows = cbk::as_rows(rows);
        p.num_heads = num_heads;
        p.head_dim = head_dim;
        p.num_groups = num_groups;
        p.d_state = d_state;
        p.x_stride = x_stride;
        p.b_stride = b_stride;
        p.c_stride = c_stride;
        p.dt_softplus = dt_softplus;
        p.dt_min = dt_min;
        p.dt_max = dt_max;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::selective_scan(p, body));
      },
      "The Mamba-2 selective scan over a varlen batch, state slots updated in place (strides in elements).");
}
