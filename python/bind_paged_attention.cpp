// cb_kernels._C.paged_attention: the C++ CPU kernel behind cb_kernels.ops.paged_attention. Its
// arguments travel as one bound PagedAttentionParams (cb_kernels/paged_attention.h, fields by
// name: data pointers as ints, sizes, element strides), already checked in Python.
#include "cb_kernels/paged_attention.h"

#include "bindings.h"

namespace py = pybind11;

void bind_paged_attention(py::module_& m) {
  using P = cbk::PagedAttentionParams;
  py::class_<P> c(m, "PagedAttentionParams",
                  "The CPU kernel's fields of cbk::PagedAttentionParams "
                  "(cb_kernels/paged_attention.h): tensor addresses as ints (sinks 0 for none), "
                  "sizes, element strides, dtype code, scale, sliding_window and softcap (0: off).");
  c.def(py::init<>());
  cbk::def_ptr(c, "q", &P::q);
  cbk::def_ptr(c, "k_cache", &P::k_cache);
  cbk::def_ptr(c, "v_cache", &P::v_cache);
  cbk::def_ptr(c, "out", &P::out);
  cbk::def_ptr(c, "block_tables", &P::block_tables);
  cbk::def_ptr(c, "seq_lens", &P::seq_lens);
  cbk::def_ptr(c, "cu_seqlens_q", &P::cu_seqlens_q);
  cbk::def_ptr(c, "sinks", &P::sinks);
  cbk::def_dtype(c, "dtype", &P::dtype);
  c.def_readwrite("num_tokens", &P::num_tokens).def_readwrite("num_heads", &P::num_heads)
      .def_readwrite("head_dim", &P::head_dim).def_readwrite("num_seqs", &P::num_seqs)
      .def_readwrite("max_blocks_per_seq", &P::max_blocks_per_seq)
      .def_readwrite("num_blocks", &P::num_blocks).def_readwrite("block_size", &P::block_size)
      .def_readwrite("num_kv_heads", &P::num_kv_heads)
      .def_readwrite("q_stride_token", &P::q_stride_token)
      .def_readwrite("q_stride_head", &P::q_stride_head)
      .def_readwrite("out_stride_token", &P::out_stride_token)
      .def_readwrite("out_stride_head", &P::out_stride_head)
      .def_readwrite("k_stride_block", &P::k_stride_block)
      .def_readwrite("k_stride_token", &P::k_stride_token)
      .def_readwrite("k_stride_head", &P::k_stride_head)
      .def_readwrite("v_stride_block", &P::v_stride_block)
      .def_readwrite("v_stride_token", &P::v_stride_token)
      .def_readwrite("v_stride_head", &P::v_stride_head)
      .def_readwrite("block_table_stride", &P::block_table_stride)
      .def_readwrite("scale", &P::scale).def_readwrite("sliding_window", &P::sliding_window)
      .def_readwrite("softcap", &P::softcap);

  m.def("paged_attention_index_error", &cbk::paged_attention_index_error, py::arg("params"),
        "\"\" or why the index tensors (host memory) are invalid: block_tables, seq_lens, "
        "cu_seqlens_q, num_seqs, max_blocks_per_seq, block_table_stride, num_tokens, num_blocks "
        "and block_size are read; see cb_kernels.ops.paged_attention.");

  m.def(
      "paged_attention",
      [](const P& p, const std::string& isa) {
        const cbk::Isa body = cbk::as_isa(isa);
        cbk::Status s;
        {
          py::gil_scoped_release release;
          s = cbk::cpu::paged_attention(p, body);
        }
        cbk::throw_if_error(s);
      },
      py::arg("params"), py::arg("isa") = "auto",
      "Paged attention on CPU tensors (see cb_kernels.ops.paged_attention). `isa` caps the body "
      "('auto': the best here; 'portable': the plain C++ one, for tests).");
}
