// CPU cache kernels: byte copies, threaded with OpenMP. No ISA-specific code (memcpy picks its
// own), but the file follows the per-ISA scheme of isa.h like every CPU kernel.
#include <omp.h>

#include <cstring>

#include "cb_kernels/cache_ops.h"
#include "isa.h"

namespace cbk {
namespace CBK_CPU_NS {

namespace {
// Below this many bytes a copy runs on the calling thread: waking the OpenMP team costs a few
// microseconds, more than copying 256 KiB at ~10 GB/s on one core (measured with
// bench/bench_cache.py on a 2-core x86 box).
constexpr int64_t kParallelBytes = 256 << 10;
}  // namespace

Status write_kv(const WriteKvParams& p) {
  if (p.num_tokens <= 0) return Status::Ok();
  const int64_t H = p.num_kv_heads, row = p.row_bytes, bs = p.block_size;
  // When heads are packed on both sides, one memcpy moves a whole token.
  const bool k_packed = p.key_stride[1] == row && p.k_cache_stride[2] == row;
  const bool v_packed = p.value_stride[1] == row && p.v_cache_stride[2] == row;
  const bool parallel = p.num_tokens * H * row * 2 >= kParallelBytes;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / bs, off = slot % bs;
    const char* ks = p.key + t * p.key_stride[0];
    const char* vs = p.value + t * p.value_stride[0];
    char* kd = p.k_cache + block * p.k_cache_stride[0] + off * p.k_cache_stride[1];
    char* vd = p.v_cache + block * p.v_cache_stride[0] + off * p.v_cache_stride[1];
    if (k_packed) {
      std::memcpy(kd, ks, H * row);
    } else {
      for (int64_t h = 0; h < H; ++h) std::memcpy(kd + h * p.k_cache_stride[2], ks + h * p.key_stride[1], row);
    }
    if (v_packed) {
      std::memcpy(vd, vs, H * row);
    } else {
      for (int64_t h = 0; h < H; ++h) std::memcpy(vd + h * p.v_cache_stride[2], vs + h * p.value_stride[1], row);
    }
  }
  return Status::Ok();
}

Status copy_blocks(const BlockCopyParams& p) {
  if (p.num_pairs <= 0 || p.num_tensors <= 0) return Status::Ok();
  int64_t bytes_per_pair = 0;
  for (int64_t t = 0; t < p.num_tensors; ++t) bytes_per_pair += p.block_bytes[t];
  const int64_t items = p.num_tensors * p.num_pairs;
  const bool parallel = bytes_per_pair * p.num_pairs >= kParallelBytes;
  // One item is one block of one tensor. Items run pair-major inside a tensor so consecutive
  // items of a thread read nearby blocks when the ids are sorted.
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / p.num_pairs, k = i % p.num_pairs;
    const int64_t src = p.block_mapping[2 * k], dst = p.block_mapping[2 * k + 1];
    const char* s = reinterpret_cast<const char*>(p.src_base[t]) + src * p.src_block_stride[t];
    char* d = reinterpret_cast<char*>(p.dst_base[t]) + dst * p.dst_block_stride[t];
    std::memcpy(d, s, p.block_bytes[t]);
  }
  return Status::Ok();
}

}  // namespace CBK_CPU_NS
}  // namespace cbk

CBK_CPU_DISPATCH(Status, write_kv, const WriteKvParams&)
CBK_CPU_DISPATCH(Status, copy_blocks, const BlockCopyParams&)
