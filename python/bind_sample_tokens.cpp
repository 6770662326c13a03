// cb_kernels._C.sample_tokens: the CPU kernel behind cb_kernels.ops.sample_tokens (which checks).
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/sample_tokens.h"

namespace py = pybind11;

void bind_sample_tokens(py::module_& m) {
  m.def(
      "sample_tokens",
      [](uintptr_t logits, uintptr_t temperature, uintptr_t u, uintptr_t out, uintptr_t logprobs,
         uintptr_t lse, int64_t num_rows, int64_t num_cols, int64_t row_stride,
         const std::string& isa) {
        cbk::SampleTokensParams p;
        p.logits = cbk::as_ptr<const float>(logits);
        p.temperature = cbk::as_ptr<const float>(temperature);
        p.u = cbk::as_ptr<const float>(u);
        p.out = cbk::as_ptr<int64_t>(out);
        p.logprobs = cbk::as_ptr<float>(logprobs);
        p.lse = cbk::as_ptr<float>(lse);
        p.num_rows = num_rows;
        p.num_cols = num_cols;
        p.row_stride = row_stride;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::sample_tokens(p, body));
      },
      py::arg("logits"), py::arg("temperature"), py::arg("u"), py::arg("out"), py::arg("logprobs"),
      py::arg("lse"), py::arg("num_rows"), py::arg("num_cols"), py::arg("row_stride"),
      py::arg("isa") = "auto",
      "out[r] = the token drawn from fp32 logits row r at temperature[r] with uniform u[r] "
      "(exact integer masses); logprobs[r], lse[r] as cb_kernels/sample_tokens.h says. "
      "temperature, logprobs and lse may be 0 (null).");
}
