// cb_kernels._C.fused_decoder: the fused CPU decoder stack (cb_kernels/fused_decoder.h) behind
// cb_kernels.ops.FusedDecoder, which owns the checks. Its arguments travel as one bound
// FusedDecoderParams (fields by name) plus the flat per-layer table of FusedDecoder.layer_table.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <stdexcept>
#include <vector>

#include "bindings.h"
#include "cb_kernels/fused_decoder.h"

namespace py = pybind11;

namespace {
constexpr size_t kLayerFields = 13;  // ops/fused_decoder.py FusedDecoder.layer_table's order

std::vector<cbk::FusedDecoderLayer> layers_of(const std::vector<int64_t>& table) {
  if (table.empty() || table.size() % kLayerFields != 0)
    throw std::invalid_argument("fused_decoder: the layer table must have 13 entries a layer");
  std::vector<cbk::FusedDecoderLayer> layers(table.size() / kLayerFields);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t* f = table.data() + i * kLayerFields;
    cbk::FusedDecoderLayer& l = layers[i];
    l.in_norm = cbk::as_ptr<const void>(f[0]);
    l.post_norm = cbk::as_ptr<const void>(f[1]);
    l.qkv = cbk::as_ptr<const void>(f[2]);
    l.o = cbk::as_ptr<const void>(f[3]);
    l.gate_up = cbk::as_ptr<const void>(f[4]);
    l.down = cbk::as_ptr<const void>(f[5]);
    l.qkv_bias = cbk::as_ptr<const float>(f[6]);
    l.o_bias = cbk::as_ptr<const float>(f[7]);
    l.gate_up_bias = cbk::as_ptr<const float>(f[8]);
    l.down_bias = cbk::as_ptr<const float>(f[9]);
    l.k_cache = cbk::as_ptr<void>(f[10]);
    l.v_cache = cbk::as_ptr<void>(f[11]);
    l.sliding_window = static_cast<int32_t>(f[12]);
  }
  return layers;
}
}  // namespace

void bind_fused_decoder(py::module_& m) {
  using P = cbk::FusedDecoderParams;
  py::class_<P> c(m, "FusedDecoderParams",
                  "The fields of cbk::FusedDecoderParams (cb_kernels/fused_decoder.h): sizes, eps, "
                  "scale, tensor addresses as ints, the caches' element strides.");
  c.def(py::init<>());
  cbk::def_dtype(c, "dtype", &P::dtype);
  c.def_readwrite("tokens", &P::tokens).def_readwrite("hidden", &P::hidden)
      .def_readwrite("heads", &P::heads).def_readwrite("kv_heads", &P::kv_heads)
      .def_readwrite("head_dim", &P::head_dim).def_readwrite("intermediate", &P::intermediate)
      .def_readwrite("eps", &P::eps).def_readwrite("scale", &P::scale)
      .def_readwrite("num_seqs", &P::num_seqs)
      .def_readwrite("max_blocks_per_seq", &P::max_blocks_per_seq)
      .def_readwrite("block_table_stride", &P::block_table_stride)
      .def_readwrite("num_blocks", &P::num_blocks).def_readwrite("block_size", &P::block_size);
  cbk::def_ptr(c, "x", &P::x);
  cbk::def_ptr(c, "out", &P::out);
  cbk::def_ptr(c, "final_norm", &P::final_norm);
  cbk::def_ptr(c, "h", &P::h);
  cbk::def_ptr(c, "qkv", &P::qkv);
  cbk::def_ptr(c, "attn", &P::attn);
  cbk::def_ptr(c, "sub", &P::sub);
  cbk::def_ptr(c, "gate_up", &P::gate_up);
  cbk::def_ptr(c, "act", &P::act);
  cbk::def_ptr(c, "cos", &P::cos);
  cbk::def_ptr(c, "sin", &P::sin);
  cbk::def_ptr(c, "slot_mapping", &P::slot_mapping);
  cbk::def_ptr(c, "block_tables", &P::block_tables);
  cbk::def_ptr(c, "seq_lens", &P::seq_lens);
  cbk::def_ptr(c, "cu_seqlens_q", &P::cu_seqlens_q);
  for (const char* name : {"k_stride", "v_stride"}) {
    const bool k = name[0] == 'k';
    c.def_property(
        name,
        [k](const P& p) {
          const int64_t* s = k ? p.k_stride : p.v_stride;
          return std::array<int64_t, 3>{s[0], s[1], s[2]};
        },
        [k](P& p, std::array<int64_t, 3> v) {
          int64_t* s = k ? p.k_stride : p.v_stride;
          for (int i = 0; i < 3; ++i) s[i] = v[i];
        });
  }

  m.def(
      "fused_decoder",
      [](P p, const std::vector<int64_t>& table) {
        const std::vector<cbk::FusedDecoderLayer> layers = layers_of(table);
        p.layers = layers.data();
        p.num_layers = static_cast<int64_t>(layers.size());
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::fused_decoder(p));
      },
      py::arg("params"), py::arg("table"),
      "The fused CPU decoder stack (see cb_kernels.ops.FusedDecoder).");
}
