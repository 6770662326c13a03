// Binding of the packed fp32 linear; cb_kernels/ops/linear.py owns the checks.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/linear.h"

namespace py = pybind11;

void bind_linear(py::module_& m) {
  m.def("linear_packed_floats", &cbk::linear_packed_floats, py::arg("n"), py::arg("k"),
        "Floats of a packed [n, k] weight.");
  m.def("linear_isa", []() { return std::string(cbk::cpu::isa_name(cbk::cpu::linear_isa())); },
        "The body linear() runs here: 'avx512', 'avx2' or 'portable'.");
  m.def(
      "linear_pack",
      [](uintptr_t weight, int64_t n, int64_t k, int64_t weight_stride, uintptr_t packed) {
        cbk::LinearPackParams p;
        p.weight = cbk::as_ptr<const float>(weight);
        p.n = n;
        p.k = k;
        p.weight_stride = weight_stride;
        p.packed = cbk::as_ptr<float>(packed);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::linear_pack(p));
      },
      py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("weight_stride"), py::arg("packed"),
      "Pack an fp32 [n, k] weight into 32-column panels.");
  m.def(
      "linear",
      [](uintptr_t x, int64_t m_rows, int64_t k, int64_t x_stride, uintptr_t packed, int64_t n,
         uintptr_t bias, uintptr_t y, int64_t y_stride, const std::string& isa) {
        cbk::LinearParams p;
        p.x = cbk::as_ptr<const float>(x);
        p.m = m_rows;
        p.k = k;
        p.x_stride = x_stride;
        p.packed = cbk::as_ptr<const float>(packed);
        p.n = n;
        p.bias = cbk::as_ptr<const float>(bias);
        p.y = cbk::as_ptr<float>(y);
        p.y_stride = y_stride;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::linear(p, body));
      },
      py::arg("x"), py::arg("m"), py::arg("k"), py::arg("x_stride"), py::arg("packed"), py::arg("n"),
      py::arg("bias"), py::arg("y"), py::arg("y_stride"), py::arg("isa") = "auto",
      "y[m, n] = x[m, k] @ W^T (+ bias) on a packed weight (bias 0: none); `isa` caps the body "
      "(every body gives the same bits).");
  m.def("linear_bf16_packed_elems", &cbk::linear_bf16_packed_elems, py::arg("n"), py::arg("k"),
        "bf16 elements of a packed bf16 [n, k] weight.");
  m.def("linear_bf16_isa",
        []() { return std::string(cbk::cpu::isa_name(cbk::cpu::linear_bf16_isa())); },
        "The body linear_bf16() runs here: 'avx512_bf16' or 'portable'.");
  m.def(
      "linear_bf16_pack",
      [](uintptr_t weight, int64_t n, int64_t k, int64_t weight_stride, uintptr_t packed) {
        cbk::LinearBf16PackParams p;
        p.weight = cbk::as_ptr<const uint16_t>(weight);
        p.n = n;
        p.k = k;
        p.weight_stride = weight_stride;
        p.packed = cbk::as_ptr<uint16_t>(packed);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::linear_bf16_pack(p));
      },
      py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("weight_stride"), py::arg("packed"),
      "Pack a bf16 [n, k] weight into 32-column panels of k pairs.");
  m.def(
      "linear_bf16",
      [](uintptr_t x, int64_t m_rows, int64_t k, int64_t x_stride, uintptr_t packed, int64_t n,
         uintptr_t bias, uintptr_t y, int64_t y_stride, const std::string& isa) {
        cbk::LinearBf16Params p;
        p.x = cbk::as_ptr<const uint16_t>(x);
        p.m = m_rows;
        p.k = k;
        p.x_stride = x_stride;
        p.packed = cbk::as_ptr<const uint16_t>(packed);
        p.n = n;
        p.bias = cbk::as_ptr<const float>(bias);
        p.y = cbk::as_ptr<uint16_t>(y);
        p.y_stride = y_stride;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::linear_bf16(p, body));
      },
      py::arg("x"), py::arg("m"), py::arg("k"), py::arg("x_stride"), py::arg("packed"), py::arg("n"),
      py::arg("bias"), py::arg("y"), py::arg("y_stride"), py::arg("isa") = "auto",
      "y[m, n] (bf16) = x[m, k] (bf16) @ W^T (+ fp32 bias) on a packed bf16 weight (bias 0: none).");
}
