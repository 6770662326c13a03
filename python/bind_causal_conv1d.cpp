// Binding of the short causal conv1d with state; cb_kernels/ops/causal_conv1d.py owns every check.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "cb_kernels/causal_conv1d.h"
#include "varlen_rows_arg.h"

namespace py = pybind11;

void bind_causal_conv1d(py::module_& m) {
  m.def(
      "causal_conv1d",
      [](uintptr_t x, uintptr_t weight, uintptr_t bias, uintptr_t conv_state, uintptr_t out,
         const cbk::VarlenRowsArg& rows, int64_t channels, int64_t width, int64_t state_len, int64_t x_stride,
         bool silu, const std::string& isa, int dtype) {
        cbk::CausalConv1dParams p;
        p.x = cbk::as_ptr<const void>(x);
        p.weight = cbk::as_ptr<const void>(weight);
        p.bias = cbk::as_ptr<const void>(bias);
        p.conv_state = cbk::as_ptr<void>(conv_state);
        p.out = cbk::as_ptr<void>(out);
        p.rows = cbk::as_rows(rows);
        p.channels = channels;
        p.width = width;
        p.state_len = state_len;
        p.x_stride = x_stride;
        p.silu = silu;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::causal_conv1d(p, body));
      },
      "Causal depthwise conv1d over a varlen batch, its window kept in state slots (x_stride in elements).");
}
