// CPU cache kernels: byte copies, threaded with OpenMP. No ISA-specific body (memcpy picks its
// own, SSE2 streaming stores are baseline x86-64), so the file is built once, portable.
#include <omp.h>

#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "cb_kernels/cache_ops.h"
#include "threads.h"

namespace cbk {
namespace cpu {

namespace {
// Below this many bytes a copy runs on the calling thread: waking the OpenMP team costs
// 5-10 us, while one core copies 1 MiB in about 100 us, so splitting smaller copies saves
// little and, on an oversubscribed machine, a descheduled team member can cost far more.
constexpr int64_t kParallelBytes = 1 << 20;

// Calls that move at least this much use non-temporal stores: the data cannot stay in the L2s
// anyway, and skipping the read-for-ownership of the destination took 32 KiB-block swaps from
// about 0.7x to 1.0-1.5x of torch's contiguous copy_ of the same bytes (64 MiB per call, 1 thread,
// 2-core EPYC; noisy shared machine, best of 15).
constexpr int64_t kStreamBytes = 4 << 20;

// memcpy with non-temporal stores: the destination bypasses the caches, so no read-for-ownership
// traffic and no eviction of the working set. d, s: n bytes.
inline void copy_nt(char* d, const char* s, int64_t n) {
#if defined(__AVX2__)
  constexpr int64_t kAlign = 32;
#elif defined(__SSE2__)
  constexpr int64_t kAlign = 16;
#else
  constexpr int64_t kAlign = 0;
#endif
  if (kAlign == 0 || n < 256) {
    std::memcpy(d, s, n);
    return;
  }
#if defined(__SSE2__)
  const int64_t head = (kAlign - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & (kAlign - 1))) & (kAlign - 1);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 4 * kAlign; n -= 4 * kAlign, d += 4 * kAlign, s += 4 * kAlign) {
#if defined(__AVX2__)
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
#else
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
#endif
  }
  std::memcpy(d, s, n);
  _mm_sfence();  // order the streamed stores before anything this thread does next
#endif
}

inline void copy_cached(char* d, const char* s, int64_t n) { std::memcpy(d, s, n); }
}  // namespace

Status write_kv(const WriteKvParams& p) {
  if (p.num_tokens <= 0) return Status::Ok();
  const int64_t H = p.num_kv_heads, row = p.row_bytes, bs = p.block_size;
  // When heads are packed on both sides, one memcpy moves a whole token.
  const bool k_packed = p.key_stride[1] == row && p.k_cache_stride[2] == row;
  const bool v_packed = p.value_stride[1] == row && p.v_cache_stride[2] == row;
  const bool parallel = p.num_tokens * H * row * 2 >= kParallelBytes;
  const bool nt = p.num_tokens * H * row * 2 >= kStreamBytes;
  auto copy = nt ? copy_nt : copy_cached;
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    const int64_t block = slot / bs, off = slot % bs;
    const char* ks = p.key + t * p.key_stride[0];
    const char* vs = p.value + t * p.value_stride[0];
    char* kd = p.k_cache + block * p.k_cache_stride[0] + off * p.k_cache_stride[1];
    char* vd = p.v_cache + block * p.v_cache_stride[0] + off * p.v_cache_stride[1];
    if (k_packed) {
      copy(kd, ks, H * row);
    } else {
      for (int64_t h = 0; h < H; ++h) copy(kd + h * p.k_cache_stride[2], ks + h * p.key_stride[1], row);
    }
    if (v_packed) {
      copy(vd, vs, H * row);
    } else {
      for (int64_t h = 0; h < H; ++h) copy(vd + h * p.v_cache_stride[2], vs + h * p.value_stride[1], row);
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
  const bool nt = bytes_per_pair * p.num_pairs >= kStreamBytes;
  // One item is one block of one tensor. Items run pair-major inside a tensor so consecutive
  // items of a thread read nearby blocks when the ids are sorted.
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / p.num_pairs, k = i % p.num_pairs;
    const int64_t src = p.block_mapping[2 * k], dst = p.block_mapping[2 * k + 1];
    const char* s = reinterpret_cast<const char*>(p.src_base[t]) + src * p.src_block_stride[t];
    char* d = reinterpret_cast<char*>(p.dst_base[t]) + dst * p.dst_block_stride[t];
    if (nt)
      copy_nt(d, s, p.block_bytes[t]);
    else
      copy_cached(d, s, p.block_bytes[t]);
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace cbk
