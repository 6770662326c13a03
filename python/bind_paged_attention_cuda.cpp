// Binding of the CUDA decode attention (csrc/cuda/paged_attention.cu). Pointers arrive as ints
// from tensor.data_ptr(); cb_kernels/ops/paged_attention/cuda.py owns every check.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/paged_attention_cuda.h"

namespace py = pybind11;

void bind_paged_attention_cuda(py::module_& m) {
  m.def("paged_attention_cuda_max_splits", [](int64_t span) { return cbk::cuda::decode_max_splits(span); },
        py::arg("span"),
        "Grid bound on the key splits of a decode query that attends at most `span` keys.");
  m.def(
      "paged_attention_cuda",
      [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out, uintptr_t block_tables,
         uintptr_t seq_lens, uintptr_t cu_seqlens_q, uintptr_t part_out, uintptr_t part_ml,
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
         int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token, int64_t out_stride_head, int64_t k_stride_block,
         int64_t k_stride_token, int64_t k_stride_head, int64_t v_stride_block, int64_t v_stride_token, int64_t v_stride_head,
         int64_t block_table_stride, int64_t max_splits, int dtype, float scale, int32_t sliding_window, float softcap,
         bool all_decode, uintptr_t stream, uintptr_t sinks) {
#if CBK_WITH_CUDA
        cbk::PagedAttentionParams p;
        p.q = cbk::as_ptr<const void>(q);
        p.k_cache = cbk::as_ptr<const void>(k_cache);
        p.v_cache = cbk::as_ptr<const void>(v_cache);
        p.out = cbk::as_ptr<void>(out);
        p.block_tables = cbk::as_ptr<const int32_t>(block_tables);
        p.seq_lens = cbk::as_ptr<const int32_t>(seq_lens);
        p.cu_seqlens_q = cbk::as_ptr<const int32_t>(cu_seqlens_q);
        p.part_out = cbk::as_ptr<float>(part_out);
        p.part_ml = cbk::as_ptr<float>(part_ml);
        p.num_seqs = num_seqs;
        p.num_heads = num_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_dim = head_dim;
        p.block_size = block_size;
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
        p.max_splits = max_splits;
        p.dtype = cbk::as_dtype(dtype);
        p.scale = scale;
        p.sliding_window = sliding_window;
        p.softcap = softcap;
        p.all_decode = all_decode;
        p.sinks = sinks ? cbk::as_ptr<const float>(sinks) : nullptr;
        cbk::Status st;
        {
          py::gil_scoped_release release;
          st = cbk::cuda::paged_attention_decode(p, reinterpret_cast<void*>(stream));
        }
        cbk::throw_if_error(st);
#else
        (void)q, (void)k_cache, (void)v_cache, (void)out, (void)block_tables, (void)seq_lens;
        (void)cu_seqlens_q, (void)part_out, (void)part_ml, (void)num_seqs, (void)num_heads;
        (void)num_kv_heads, (void)head_dim, (void)block_size, (void)q_stride_token, (void)q_stride_head;
        (void)out_stride_token, (void)out_stride_head, (void)k_stride_block, (void)k_stride_token, (void)k_stride_head;
        (void)v_stride_block, (void)v_stride_token, (void)v_stride_head, (void)block_table_stride, (void)max_splits;
        (void)dtype, (void)scale, (void)sliding_window, (void)softcap, (void)all_decode, (void)stream;
        (void)sinks;
        throw std::runtime_error(
            "cb_kernels was built without CUDA kernels (no nvcc at build time, or CBK_CUDA=off): "
            "paged_attention_cuda is unavailable; rebuild with CBK_CUDA=on or use backend='triton'");
#endif
      },
      "Split-KV decode attention over a paged KV cache on `stream` (see paged_attention_cuda.h); "
      "`sinks`: address of fp32 [num_heads] sink logits, 0 for none.");
}
