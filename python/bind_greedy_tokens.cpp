// cb_kernels._C.greedy_tokens: the CPU kernel behind cb_kernels.ops.greedy_tokens, which owns the checks.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/greedy_tokens.h"

namespace py = pybind11;

void bind_greedy_tokens(py::module_& m) {
  m.def(
      "greedy_tokens",
      [](uintptr_t logits, uintptr_t out, int64_t num_rows, int64_t num_cols, int64_t row_stride,
         const std::string& isa) {
        cbk::GreedyTokensParams p;
        p.logits = cbk::as_ptr<const float>(logits);
        p.out = cbk::as_ptr<int64_t>(out);
        p.num_rows = num_rows;
        p.num_cols = num_cols;
        p.row_stride = row_stride;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::greedy_tokens(p, body));
      },
      py::arg("logits"), py::arg("out"), py::arg("num_rows"), py::arg("num_cols"), py::arg("row_stride"),
      py::arg("isa") = "auto",
      "out[r] = first index of the largest value of fp32 row r (NaN counts as largest).");
}
