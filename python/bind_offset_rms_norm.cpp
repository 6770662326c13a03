// Binding of Qwen3-Next's (1 + weight) RMSNorm; cb_kernels/ops/offset_rms_norm.py owns the checks.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "cb_kernels/offset_rms_norm.h"

namespace py = pybind11;

void bind_offset_rms_norm(py::module_& m) {
  m.def(
      "offset_rms_norm",
      [](uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, int64_t rows,
         int64_t dim, int64_t x_stride, int64_t residual_stride, float eps,
         const std::string& isa, int dtype) {
        cbk::OffsetRmsNormParams p;
        p.x = cbk::as_ptr<void>(x);
        p.residual = residual ? cbk::as_ptr<const void>(residual) : nullptr;
        p.weight = cbk::as_ptr<const void>(weight);
        p.out = cbk::as_ptr<void>(out);
        p.rows = rows;
        p.dim = dim;
        p.x_stride = x_stride;
        p.residual_stride = residual_stride;
        p.eps = eps;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::offset_rms_norm(p, body));
      },
      "RMSNorm scaled by (1 + weight) in fp32, residual added first (strides in elements).");
}
