// KV cache kernels: write_kv, and block copies (copy_blocks inside one pool, swap_blocks between
// a device pool and a host pool). Torch-free: raw pointers, sizes and byte strides. Everything
// is byte-addressed (a head_dim row is row_bytes), so one kernel serves every dtype and the
// copies are bit-exact.
#pragma once

#include <cstdint>
#include <string>

#include "cb_kernels/common.h"

namespace cbk {

// Scatter num_tokens tokens into their cache slots; slot -1 skips the token.
struct WriteKvParams {
  const char* key = nullptr;          // [num_tokens, num_kv_heads, head_dim], head_dim packed
  const char* value = nullptr;        // same shape as key
  char* k_cache = nullptr;            // [num_blocks, block_size, num_kv_heads, head_dim]
  char* v_cache = nullptr;            // same shape as k_cache
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; slot = block * block_size + offset, or -1
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t row_bytes = 0;              // head_dim * element size
  int64_t key_stride[2] = {0, 0};     // bytes between tokens, heads
  int64_t value_stride[2] = {0, 0};
  int64_t k_cache_stride[3] = {0, 0, 0};  // bytes between blocks, offsets, heads
  int64_t v_cache_stride[3] = {0, 0, 0};
};

// For each pair (src, dst) of block_mapping and each tensor t:
//   copy block_bytes[t] bytes from src_base[t] + src * src_block_stride[t]
//                              to   dst_base[t] + dst * dst_block_stride[t].
// The wrappers guarantee distinct destinations that are never also sources, so pairs and
// tensors may run in any order.
struct BlockCopyParams {
  int64_t num_tensors = 0;
  const uintptr_t* src_base = nullptr;         // [num_tensors]
  const uintptr_t* dst_base = nullptr;         // [num_tensors]
  const int64_t* block_bytes = nullptr;        // [num_tensors]
  const int64_t* src_block_stride = nullptr;   // [num_tensors], bytes
  const int64_t* dst_block_stride = nullptr;   // [num_tensors], bytes
  const int64_t* block_mapping = nullptr;      // [num_pairs, 2] (src, dst), host memory
  int64_t num_pairs = 0;
};

namespace cpu {
Status write_kv(const WriteKvParams& p);
Status copy_blocks(const BlockCopyParams& p);  // threaded memcpy over (tensor, block) pairs
}  // namespace cpu

namespace cuda {
// Every function queues work on `stream` (a cudaStream_t, 0 = legacy default) and returns without
// waiting for it. The current device must be the one that owns the device pointers.
Status write_kv(const WriteKvParams& p, void* stream);

// Block copies as one kernel launch over every (tensor, pair). `p` (host arrays) gives the
// geometry; `table_dev` holds the same per-tensor rows on the device, int64 [num_tensors, 5] =
// (src_base, dst_base, block_bytes, src_block_stride, dst_block_stride), with device-accessible
// pointers (mapped pinned host memory works: this is the zero-copy swap path); `pairs_dev` is
// int64 [num_pairs, 2] on the device.
Status copy_blocks(const BlockCopyParams& p, const int64_t* table_dev, const int64_t* pairs_dev, void* stream);

// Block copies through the copy engines from p's host arrays alone: one cuMemcpyBatchAsync call
// (batched = true) or one cudaMemcpyAsync per run of consecutive blocks (batched = false).
Status memcpy_blocks(const BlockCopyParams& p, bool batched, void* stream);

// Which swap path to take: 1 = memcpy_blocks batched, 2 = copy_blocks kernel, 3 = memcpy_blocks
// one by one. requested 0 = auto: batched when the driver has it, the stream is not the legacy
// default stream (the batch API refuses it) and blocks are at least batch_min_bytes.
int swap_method(int64_t min_block_bytes, void* stream, int requested, int64_t batch_min_bytes);

// "" when cuMemcpyBatchAsync is available, else why not.
std::string batch_memcpy_error();

// Device address of pinned host memory (0 when the pointer is not page-locked / mapped).
uintptr_t host_device_pointer(uintptr_t host_ptr);
}  // namespace cuda

}  // namespace cbk
