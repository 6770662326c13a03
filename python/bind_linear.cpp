// Binding of the packed fp32 linear; cb_kernels/ops/linear.py owns the checks.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "cb_kernels/linear.h"

namespace py = pybind11;

namespace {

// The pack and run bindings of one element type: P/PP the run and pack params, T the element.
template <typename P, typename PP, typename T, cbk::Status (*run)(const P&, cbk::Isa),
          cbk::Status (*pack)(const PP&)>
void def_linear(py::module_& m, const char* name, const char* pack_name, const char* doc,
                const char* pack_doc) {
  m.def(
      pack_name,
      [](uintptr_t weight, int64_t n, int64_t k, int64_t weight_stride, uintptr_t packed) {
        const PP p = cbk::linear_pack_params<PP, T>(cbk::as_ptr<const void>(weight), n, k,
                                                    weight_stride, cbk::as_ptr<void>(packed));
        py::gil_scoped_release nogil;
        cbk::throw_if_error(pack(p));
      },
      py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("weight_stride"), py::arg("packed"),
      pack_doc);
  m.def(
      name,
      [](uintptr_t x, int64_t m_rows, int64_t k, int64_t x_stride, uintptr_t packed, int64_t n,
         uintptr_t bias, uintptr_t y, int64_t y_stride, const std::string& isa) {
        const P p = cbk::linear_params<P, T>(cbk::as_ptr<const void>(x), m_rows, k, x_stride,
                                             cbk::as_ptr<const void>(packed), n,
                                             cbk::as_ptr<const float>(bias), cbk::as_ptr<void>(y),
                                             y_stride);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(run(p, body));
      },
      py::arg("x"), py::arg("m"), py::arg("k"), py::arg("x_stride"), py::arg("packed"), py::arg("n"),
      py::arg("bias"), py::arg("y"), py::arg("y_stride"), py::arg("isa") = "auto", doc);
}

cbk::Status linear_fp32(const cbk::LinearParams& p, cbk::Isa isa) { return cbk::cpu::linear(p, isa); }
cbk::Status linear_bf16(const cbk::LinearBf16Params& p, cbk::Isa isa) {
  return cbk::cpu::linear_bf16(p, isa);
}
cbk::Status pack_fp32(const cbk::LinearPackParams& p) { return cbk::cpu::linear_pack(p); }
cbk::Status pack_bf16(const cbk::LinearBf16PackParams& p) { return cbk::cpu::linear_bf16_pack(p); }

}  // namespace

void bind_linear(py::module_& m) {
  m.def("linear_packed_floats", &cbk::linear_packed_floats, py::arg("n"), py::arg("k"),
        "Floats of a packed [n, k] weight.");
  m.def("linear_isa", []() { return std::string(cbk::cpu::isa_name(cbk::cpu::linear_isa())); },
        "The body linear() runs here: 'avx512', 'avx2' or 'portable'.");
  def_linear<cbk::LinearParams, cbk::LinearPackParams, float, linear_fp32, pack_fp32>(
      m, "linear", "linear_pack",
      "y[m, n] = x[m, k] @ W^T (+ bias) on a packed weight (bias 0: none); `isa` caps the body "
      "(every body gives the same bits).",
      "Pack an fp32 [n, k] weight into 32-column panels.");
  m.def("linear_bf16_packed_elems", &cbk::linear_bf16_packed_elems, py::arg("n"), py::arg("k"),
        "bf16 elements of a packed bf16 [n, k] weight.");
  m.def("linear_bf16_isa",
        []() { return std::string(cbk::cpu::isa_name(cbk::cpu::linear_bf16_isa())); },
        "The body linear_bf16() runs here: 'avx512_bf16' or 'portable'.");
  def_linear<cbk::LinearBf16Params, cbk::LinearBf16PackParams, uint16_t, linear_bf16, pack_bf16>(
      m, "linear_bf16", "linear_bf16_pack",
      "y[m, n] (bf16) = x[m, k] (bf16) @ W^T (+ fp32 bias) on a packed bf16 weight (bias 0: none).",
      "Pack a bf16 [n, k] weight into 32-column panels of k pairs.");
}
