// cb_kernels._C.paged_attention: the C++ CPU kernel behind cb_kernels.ops.paged_attention.
// Arguments arrive as data pointers, sizes and element strides, already checked in Python. They
// stay positional, not a bound PagedAttentionParams filled by name: that was tried and cost
// 2.6 us a call from Python (a 1-token decode through run_backend 6.3 -> 8.9 us on one thread of
// the Zen 4 box, bench_paged_attention), and this call runs once per layer per step.
#include "cb_kernels/paged_attention.h"

#include "bindings.h"

namespace py = pybind11;

void bind_paged_attention(py::module_& m) {
  m.def(
      "paged_attention_index_error",
      [](uintptr_t block_tables, uintptr_t seq_lens, uintptr_t cu_seqlens_q, int64_t num_seqs,
         int64_t max_blocks_per_seq, int64_t block_table_stride, int64_t num_tokens,
         int64_t num_blocks, int64_t block_size) {
        cbk::PagedAttentionParams p;
        p.block_tables = cbk::as_ptr<const int32_t>(block_tables);
        p.seq_lens = cbk::as_ptr<const int32_t>(seq_lens);
        p.cu_seqlens_q = cbk::as_ptr<const int32_t>(cu_seqlens_q);
        p.num_seqs = num_seqs;
        p.max_blocks_per_seq = max_blocks_per_seq;
        p.block_table_stride = block_table_stride;
        p.num_tokens = num_tokens;
        p.num_blocks = num_blocks;
        p.block_size = block_size;
        return cbk::paged_attention_index_error(p);
      },
      "\"\" or why the index tensors (host memory) are invalid; see "
      "cb_kernels.ops.paged_attention.",
      py::arg("block_tables"), py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("num_seqs"),
      py::arg("max_blocks_per_seq"), py::arg("block_table_stride"), py::arg("num_tokens"),
      py::arg("num_blocks"), py::arg("block_size"));

  m.def(
      "paged_attention",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
         uintptr_t seq_lens, uintptr_t cu_seqlens_q, uintptr_t out, int64_t num_tokens,
         int64_t num_heads, int64_t head_dim, int64_t num_seqs, int64_t max_blocks_per_seq,
         int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t q_stride_token,
         int64_t q_stride_head, int64_t out_stride_token, int64_t out_stride_head,
         int64_t k_stride_block, int64_t k_stride_token, int64_t k_stride_head,
         int64_t v_stride_block, int64_t v_stride_token, int64_t v_stride_head,
         int64_t block_table_stride, int dtype, double scale, int64_t sliding_window,
         double softcap, const std::string& isa, uintptr_t sinks) {
        cbk::PagedAttentionParams p;
        p.q = cbk::as_ptr<const void>(q);
        p.k_cache = cbk::as_ptr<const void>(k_cache);
        p.v_cache = cbk::as_ptr<const void>(v_cache);
        p.block_tables = cbk::as_ptr<const int32_t>(block_tables);
        p.seq_lens = cbk::as_ptr<const int32_t>(seq_lens);
        p.cu_seqlens_q = cbk::as_ptr<const int32_t>(cu_seqlens_q);
        p.out = cbk::as_ptr<void>(out);
        p.num_tokens = num_tokens;
        p.num_heads = num_heads;
        p.head_dim = head_dim;
        p.num_seqs = num_seqs;
        p.max_blocks_per_seq = max_blocks_per_seq;
        p.num_blocks = num_blocks;
        p.block_size = block_size;
        p.num_kv_heads = num_kv_heads;
        p.q_stride_token = q_stride_token;
        p.q_stride_head = q_stride_head;
        p.out_stride_token = out_stride_token;
        p.out_stride_head = out_stride_head;
        p.k_stride_block = k_stride_block;
        p.k_stride_token = k_stride_token;
        p.k_stride_head = k_stride_head;
        p.v_stride_block = v_stride_block;
        p.v_stride_token = v_stride_token;
        p.v_stride_head = v_stride_head;
        p.block_table_stride = block_table_stride;
        p.dtype = cbk::as_dtype(dtype);
        p.scale = static_cast<float>(scale);
        p.sliding_window = static_cast<int32_t>(sliding_window);
        p.softcap = static_cast<float>(softcap);
        p.sinks = sinks ? cbk::as_ptr<const float>(sinks) : nullptr;
        const cbk::Isa body = cbk::as_isa(isa);
        cbk::Status s;
        {
          py::gil_scoped_release release;
          s = cbk::cpu::paged_attention(p, body);
        }
        cbk::throw_if_error(s);
      },
      "Paged attention on CPU tensors (see cb_kernels.ops.paged_attention). `isa` caps the body "
      "('auto': the best here; 'portable': the plain C++ one, for tests). `sinks`: address of "
      "fp32 [num_heads] sink logits, 0 for none.",
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
      py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("out"), py::arg("num_tokens"),
      py::arg("num_heads"), py::arg("head_dim"), py::arg("num_seqs"),
      py::arg("max_blocks_per_seq"), py::arg("num_blocks"), py::arg("block_size"),
      py::arg("num_kv_heads"), py::arg("q_stride_token"), py::arg("q_stride_head"),
      py::arg("out_stride_token"), py::arg("out_stride_head"), py::arg("k_stride_block"),
      py::arg("k_stride_token"), py::arg("k_stride_head"), py::arg("v_stride_block"),
      py::arg("v_stride_token"), py::arg("v_stride_head"), py::arg("block_table_stride"),
      py::arg("dtype"), py::arg("scale"), py::arg("sliding_window"), py::arg("softcap"),
      py::arg("isa") = "auto", py::arg("sinks") = 0);
}
