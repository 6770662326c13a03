// Bindings of the cache kernels. Pointers arrive as ints (tensor.data_ptr()) and every stride
// in bytes; the wrappers in cb_kernels/ops/cache_ops.py own all checks. The GIL is released
// while a kernel runs, so a swap on one Python thread overlaps work on another.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <stdexcept>
#include <vector>

#include "bindings.h"
#include "cb_kernels/cache_ops.h"

namespace py = pybind11;

namespace {
using Stride2 = std::array<int64_t, 2>;
using Stride3 = std::array<int64_t, 3>;

cbk::WriteKvParams write_kv_params(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache,
                                   uintptr_t slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                                   int64_t block_size, int64_t row_bytes, Stride2 key_stride, Stride2 value_stride,
                                   Stride3 k_cache_stride, Stride3 v_cache_stride) {
  if (num_tokens < 0 || num_kv_heads <= 0 || block_size <= 0 || row_bytes <= 0)
    throw std::invalid_argument("write_kv: num_tokens >= 0 and num_kv_heads, block_size, row_bytes > 0");
  cbk::WriteKvParams p;
  p.key = cbk::as_ptr<const char>(key);
  p.value = cbk::as_ptr<const char>(value);
  p.k_cache = cbk::as_ptr<char>(k_cache);
  p.v_cache = cbk::as_ptr<char>(v_cache);
  p.slot_mapping = cbk::as_ptr<const int64_t>(slot_mapping);
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.row_bytes = row_bytes;
  for (int i = 0; i < 2; ++i) {
    p.key_stride[i] = key_stride[i];
    p.value_stride[i] = value_stride[i];
  }
  for (int i = 0; i < 3; ++i) {
    p.k_cache_stride[i] = k_cache_stride[i];
    p.v_cache_stride[i] = v_cache_stride[i];
  }
  return p;
}

// Owns the per-tensor arrays a BlockCopyParams points into.
struct BlockCopyArgs {
  std::vector<uintptr_t> src, dst;
  std::vector<int64_t> block_bytes, src_stride, dst_stride;
  cbk::BlockCopyParams params() const {
    cbk::BlockCopyParams p;
    p.num_tensors = static_cast<int64_t>(src.size());
    p.src_base = src.data();
    p.dst_base = dst.data();
    p.block_bytes = block_bytes.data();
    p.src_block_stride = src_stride.data();
    p.dst_block_stride = dst_stride.data();
    return p;
  }
};

BlockCopyArgs block_copy_args(std::vector<uintptr_t> src, std::vector<uintptr_t> dst, std::vector<int64_t> block_bytes,
                              std::vector<int64_t> src_stride, std::vector<int64_t> dst_stride) {
  const size_t n = src.size();
  if (dst.size() != n || block_bytes.size() != n || src_stride.size() != n || dst_stride.size() != n)
    throw std::invalid_argument("block copy: src, dst, block_bytes and strides must have one entry per tensor");
  for (int64_t b : block_bytes)
    if (b <= 0) throw std::invalid_argument("block copy: block_bytes must be positive");
  return BlockCopyArgs{std::move(src), std::move(dst), std::move(block_bytes), std::move(src_stride),
                       std::move(dst_stride)};
}

#if CBK_WITH_CUDA
void bind_cache_ops_cuda(py::module_& m) {
  m.def(
      "write_kv_cuda",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
         int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t row_bytes, Stride2 key_stride,
         Stride2 value_stride, Stride3 k_cache_stride, Stride3 v_cache_stride, uintptr_t stream) {
        const auto p = write_kv_params(key, value, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads,
                                       block_size, row_bytes, key_stride, value_stride, k_cache_stride,
                                       v_cache_stride);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cuda::write_kv(p, cbk::as_ptr<void>(stream)));
      },
      "CUDA write_kv, queued on `stream`.");
  m.def(
      "copy_blocks_cuda",
      [](std::vector<uintptr_t> src, std::vector<uintptr_t> dst, std::vector<int64_t> block_bytes,
         std::vector<int64_t> src_stride, std::vector<int64_t> dst_stride, int64_t num_pairs, uintptr_t table_dev,
         uintptr_t pairs_dev, uintptr_t stream) {
        const auto args = block_copy_args(std::move(src), std::move(dst), std::move(block_bytes),
                                          std::move(src_stride), std::move(dst_stride));
        auto p = args.params();
        p.num_pairs = num_pairs;
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cuda::copy_blocks(p, cbk::as_ptr<const int64_t>(table_dev),
                                                   cbk::as_ptr<const int64_t>(pairs_dev), cbk::as_ptr<void>(stream)));
      },
      "CUDA block-copy kernel over every (tensor, pair) in one launch; tables already on the device.");
  m.def(
      "memcpy_blocks_cuda",
      [](std::vector<uintptr_t> src, std::vector<uintptr_t> dst, std::vector<int64_t> block_bytes,
         std::vector<int64_t> src_stride, std::vector<int64_t> dst_stride, uintptr_t block_mapping,
         int64_t num_pairs, bool batched, uintptr_t stream) {
        const auto args = block_copy_args(std::move(src), std::move(dst), std::move(block_bytes),
                                          std::move(src_stride), std::move(dst_stride));
        auto p = args.params();
        p.block_mapping = cbk::as_ptr<const int64_t>(block_mapping);
        p.num_pairs = num_pairs;
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cuda::memcpy_blocks(p, batched, cbk::as_ptr<void>(stream)));
      },
      "Copy-engine block copies: one cuMemcpyBatchAsync (batched) or one cudaMemcpyAsync per run.");
  m.def("cuda_swap_method",
        [](int64_t min_block_bytes, uintptr_t stream, int requested, int64_t batch_min_bytes) {
          return cbk::cuda::swap_method(min_block_bytes, cbk::as_ptr<void>(stream), requested, batch_min_bytes);
        });
  m.def("cuda_batch_memcpy_error", []() { return cbk::cuda::batch_memcpy_error(); });
  m.def("cuda_host_device_pointer", [](uintptr_t p) { return cbk::cuda::host_device_pointer(p); });
}
#else
void bind_cache_ops_cuda(py::module_& m) {
  const char* why = "cb_kernels was built without CUDA kernels (no nvcc at build time, or CBK_CUDA=off)";
  for (const char* name : {"write_kv_cuda", "copy_blocks_cuda", "memcpy_blocks_cuda", "cuda_swap_method"})
    m.def(name, [why](py::args, py::kwargs) { throw std::runtime_error(why); });
  m.def("cuda_batch_memcpy_error", [why]() { return std::string(why); });
  m.def("cuda_host_device_pointer", [](uintptr_t) { return uintptr_t(0); });
}
#endif
}  // namespace

void bind_cache_ops(py::module_& m) {
  m.def(
      "write_kv",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
         int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t row_bytes, Stride2 key_stride,
         Stride2 value_stride, Stride3 k_cache_stride, Stride3 v_cache_stride) {
        const auto p = write_kv_params(key, value, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads,
                                       block_size, row_bytes, key_stride, value_stride, k_cache_stride,
                                       v_cache_stride);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::write_kv(p));
      },
      "CPU write_kv (byte strides; see cb_kernels/cache_ops.h).");
  m.def(
      "copy_blocks",
      [](std::vector<uintptr_t> src, std::vector<uintptr_t> dst, std::vector<int64_t> block_bytes,
         std::vector<int64_t> src_stride, std::vector<int64_t> dst_stride, uintptr_t block_mapping,
         int64_t num_pairs) {
        const auto args = block_copy_args(std::move(src), std::move(dst), std::move(block_bytes),
                                          std::move(src_stride), std::move(dst_stride));
        auto p = args.params();
        p.block_mapping = cbk::as_ptr<const int64_t>(block_mapping);
        p.num_pairs = num_pairs;
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::copy_blocks(p));
      },
      "CPU block copy for copy_blocks and swap_blocks: threaded memcpy over (tensor, block) pairs.");

  bind_cache_ops_cuda(m);
}
