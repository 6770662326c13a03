// Bindings of the fused decoder-layer operations; cb_kernels/ops/elementwise.py owns the checks.
// `isa` caps the body (cb_kernels/isa.h): "auto", or "portable" to test the plain C++ one.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>

#include "bindings.h"
#include "cb_kernels/elementwise.h"

namespace py = pybind11;

namespace {
using Stride2 = std::array<int64_t, 2>;
using Stride3 = std::array<int64_t, 3>;

cbk::RopeParams rope_params(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t tokens, int64_t heads,
                            int64_t head_dim, Stride2 stride, int dtype) {
  cbk::RopeParams p;
  p.x = cbk::as_ptr<void>(x);
  p.cos = cbk::as_ptr<const void>(cos);
  p.sin = cbk::as_ptr<const void>(sin);
  p.tokens = tokens;
  p.heads = heads;
  p.head_dim = head_dim;
  p.token_stride = stride[0];
  p.head_stride = stride[1];
  p.dtype = cbk::as_dtype(dtype);
  return p;
}
}  // namespace

void bind_elementwise(py::module_& m) {
  m.def(
      "rms_norm",
      [](uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, int64_t rows, int64_t dim,
         int64_t x_stride, int64_t residual_stride, int64_t out_stride, float eps,
         const std::string& isa, int dtype) {
        cbk::RmsNormParams p;
        p.x = cbk::as_ptr<void>(x);
        p.residual = cbk::as_ptr<const void>(residual);
        p.weight = cbk::as_ptr<const void>(weight);
        p.out = cbk::as_ptr<void>(out);
        p.rows = rows;
        p.dim = dim;
        p.x_stride = x_stride;
        p.residual_stride = residual_stride;
        p.out_stride = out_stride;
        p.eps = eps;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::rms_norm(p, body));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("out"), py::arg("rows"),
      py::arg("dim"), py::arg("x_stride"), py::arg("residual_stride"), py::arg("out_stride"),
      py::arg("eps"), py::arg("isa") = "auto", py::arg("dtype") = 0,
      "x += residual (when not 0), then out = weight * x / sqrt(mean(x^2) + eps), per row; dtype 0 fp32, 2 bf16.");
  m.def(
      "silu_mul",
      [](uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, int64_t in_stride, int64_t out_stride,
         const std::string& isa, int dtype) {
        cbk::SiluMulParams p;
        p.gate_up = cbk::as_ptr<const void>(gate_up);
        p.out = cbk::as_ptr<void>(out);
        p.rows = rows;
        p.dim = dim;
        p.in_stride = in_stride;
        p.out_stride = out_stride;
        p.dtype = cbk::as_dtype(dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::silu_mul(p, body));
      },
      py::arg("gate_up"), py::arg("out"), py::arg("rows"), py::arg("dim"), py::arg("in_stride"),
      py::arg("out_stride"), py::arg("isa") = "auto", py::arg("dtype") = 0,
      "out = silu(gate_up[:, :dim]) * gate_up[:, dim:].");
  m.def(
      "rope",
      [](uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t tokens, int64_t heads, int64_t head_dim,
         int64_t token_stride, int64_t head_stride, const std::string& isa, int dtype) {
        const cbk::RopeParams p =
            rope_params(x, cos, sin, tokens, heads, head_dim, {token_stride, head_stride}, dtype);
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::rope(p, body));
      },
      py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("tokens"), py::arg("heads"),
      py::arg("head_dim"), py::arg("token_stride"), py::arg("head_stride"), py::arg("isa") = "auto", py::arg("dtype") = 0,
      "Rotary embedding in place: x = x * cos + rotate_half(x) * sin.");
  m.def(
      "rope_write_kv",
      [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t cos, uintptr_t sin, uintptr_t k_cache,
         uintptr_t v_cache, uintptr_t slot_mapping, int64_t tokens, int64_t q_heads, int64_t kv_heads,
         int64_t head_dim, Stride2 q_stride, Stride2 k_stride, Stride2 v_stride, Stride3 k_cache_stride,
         Stride3 v_cache_stride, int64_t block_size, int64_t num_slots, const std::string& isa, int dtype) {
        cbk::RopeWriteKvParams p;
        p.q = rope_params(q, cos, sin, tokens, q_heads, head_dim, q_stride, dtype);
        p.k = rope_params(k, cos, sin, tokens, kv_heads, head_dim, k_stride, dtype);
        p.value = cbk::as_ptr<const void>(v);
        p.value_token_stride = v_stride[0];
        p.value_head_stride = v_stride[1];
        p.k_cache = cbk::as_ptr<void>(k_cache);
        p.v_cache = cbk::as_ptr<void>(v_cache);
        for (int i = 0; i < 3; ++i) {
          p.k_cache_stride[i] = k_cache_stride[i];
          p.v_cache_stride[i] = v_cache_stride[i];
        }
        p.slot_mapping = cbk::as_ptr<const int64_t>(slot_mapping);
        p.block_size = block_size;
        p.num_slots = num_slots;
        const cbk::Isa body = cbk::as_isa(isa);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::rope_write_kv(p, body));
      },
      "rope(q), rope(k) in place, then k and v into their cache slots (strides in elements).");
}
