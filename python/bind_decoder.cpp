// cb_kernels._C.decoder_layers: the fused CPU decoder stack (cb_kernels/decoder.h) behind
// cb_kernels.ops.FusedDecoder, which owns the checks.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <stdexcept>
#include <vector>

#include "bindings.h"
#include "cb_kernels/decoder.h"

namespace py = pybind11;

namespace {
constexpr size_t kLayerFields = 13;  // ops/decoder.py FusedDecoder.layer_table's order
}

void bind_decoder(py::module_& m) {
  m.def(
      "decoder_layers",
      [](const std::vector<int64_t>& table, int dtype, int64_t tokens, int64_t hidden, int64_t heads,
         int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
         uintptr_t x, uintptr_t out, uintptr_t final_norm, uintptr_t h, uintptr_t qkv, uintptr_t attn,
         uintptr_t sub, uintptr_t gate_up, uintptr_t act, uintptr_t cos, uintptr_t sin,
         uintptr_t slot_mapping, uintptr_t block_tables, uintptr_t seq_lens, uintptr_t cu_seqlens_q,
         int64_t num_seqs, int64_t max_blocks_per_seq, int64_t block_table_stride, int64_t num_blocks,
         int64_t block_size, std::array<int64_t, 3> k_stride, std::array<int64_t, 3> v_stride) {
        if (table.empty() || table.size() % kLayerFields != 0)
          throw std::invalid_argument("decoder_layers: the layer table must have 13 entries a layer");
        std::vector<cbk::DecoderLayer> layers(table.size() / kLayerFields);
        for (size_t i = 0; i < layers.size(); ++i) {
          const int64_t* f = table.data() + i * kLayerFields;
          cbk::DecoderLayer& l = layers[i];
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
        cbk::DecoderParams p;
        p.layers = layers.data();
        p.num_layers = static_cast<int64_t>(layers.size());
        p.dtype = cbk::as_dtype(dtype);
        p.tokens = tokens;
        p.hidden = hidden;
        p.heads = heads;
        p.kv_heads = kv_heads;
        p.head_dim = head_dim;
        p.intermediate = intermediate;
        p.eps = static_cast<float>(eps);
        p.scale = static_cast<float>(scale);
        p.x = cbk::as_ptr<void>(x);
        p.out = cbk::as_ptr<void>(out);
        p.final_norm = cbk::as_ptr<const void>(final_norm);
        p.h = cbk::as_ptr<void>(h);
        p.qkv = cbk::as_ptr<void>(qkv);
        p.attn = cbk::as_ptr<void>(attn);
        p.sub = cbk::as_ptr<void>(sub);
        p.gate_up = cbk::as_ptr<void>(gate_up);
        p.act = cbk::as_ptr<void>(act);
        p.cos = cbk::as_ptr<const void>(cos);
        p.sin = cbk::as_ptr<const void>(sin);
        p.slot_mapping = cbk::as_ptr<const int64_t>(slot_mapping);
        p.block_tables = cbk::as_ptr<const int32_t>(block_tables);
        p.seq_lens = cbk::as_ptr<const int32_t>(seq_lens);
        p.cu_seqlens_q = cbk::as_ptr<const int32_t>(cu_seqlens_q);
        p.num_seqs = num_seqs;
        p.max_blocks_per_seq = max_blocks_per_seq;
        p.block_table_stride = block_table_stride;
        p.num_blocks = num_blocks;
        p.block_size = block_size;
        for (int i = 0; i < 3; ++i) {
          p.k_stride[i] = k_stride[i];
          p.v_stride[i] = v_stride[i];
        }
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::decoder_layers(p));
      },
      "The fused CPU decoder stack (see cb_kernels.ops.FusedDecoder).");
}
