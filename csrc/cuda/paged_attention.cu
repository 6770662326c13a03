// Split-KV decode attention over a paged KV cache (see cb_kernels/paged_attention_cuda.h).
//
// One CTA of 128 threads owns (sequence, kv head, up to 8 of its query heads, one key split) and
// reads every K/V row of its split once for all those heads: a GQA group of <= 8 heads costs one
// pass over its KV. Threads form token groups of kThreadsPerToken lanes; each lane loads 16-byte
// vectors of a K or V row (8 fp16/bf16 or 4 fp32 values), so a group covers one row of head_dim.
// Keys go through in chunks of kDecodeChunk: scores for the chunk -> shared memory, a per-head
// online-softmax step by one warp per head, then P.V accumulated in fp32 registers. Splits of one
// sequence are merged in split order by reduce_kernel. All address math is int64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cb_kernels/paged_attention_cuda.h"

namespace cbk {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeads = 8;  // query heads per CTA; a larger GQA group spans several CTAs
constexpr int kChunk = static_cast<int>(kDecodeChunk);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;  // values per 16-byte load
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
  __device__ static void unpack(const uint4& raw, float* f) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
  }
};

template <>
struct Elem<__half> {
  static constexpr int kVec = 8;
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static void unpack(const uint4& raw, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static void unpack(const uint4& raw, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// How the 128 threads cover a head_dim row of T with 16-byte vectors.
template <typename T, int HEAD_DIM>
struct Layout {
  static constexpr int kVec = Elem<T>::kVec;
  static constexpr int kNumVecs = HEAD_DIM / kVec;  // vectors per row
  static constexpr int kLanes = pow2_at_least(kNumVecs) < 32 ? pow2_at_least(kNumVecs) : 32;
  static constexpr int kVecsPerLane = (kNumVecs + kLanes - 1) / kLanes;
  static constexpr int kGroups = kThreads / kLanes;           // token groups per CTA
  static constexpr int kTokensPerGroup = kChunk / kGroups;    // keys per group per chunk
  static constexpr int kUnroll = kTokensPerGroup < 4 ? kTokensPerGroup : 4;  // rows in flight
  static_assert(HEAD_DIM % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
  static_assert(kChunk % kGroups == 0 && kTokensPerGroup % kUnroll == 0, "chunk split");
};

template <typename T, int HEAD_DIM>
struct Shared {
  float q[kMaxHeads][HEAD_DIM];  // scaled queries
  float p[kMaxHeads][kChunk];    // scores, then probabilities, of the current chunk
  float red[Layout<T, HEAD_DIM>::kGroups][kMaxHeads][HEAD_DIM];  // per-group partial P.V
  float m[kMaxHeads], l[kMaxHeads], alpha[kMaxHeads];
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// tanh for the softcap. --use_fast_math turns tanhf into tanh.approx.f32 (relative error
// ~2^-11), too coarse for fp32 scores; 1 - 2 / (2^(2x log2 e) + 1) keeps the error near one fp32
// ulp of 1 through ex2.approx (2^-22) and is exact at both infinities, as the Triton kernel does.
__device__ __forceinline__ float softcap_tanh(float x) {
  return 1.0f - 2.0f / (exp2f(x * (2.0f * 1.4426950408889634f)) + 1.0f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Row `pos` of one kv head: element offset of its first value, through the block table.
__device__ __forceinline__ int64_t row_offset(const int32_t* bt, int pos, int shift, int mask,
                                              int64_t stride_b, int64_t stride_t) {
  return static_cast<int64_t>(bt[pos >> shift]) * stride_b + static_cast<int64_t>(pos & mask) * stride_t;
}

// kUnroll K or V rows of this thread's group (chunk rows c0 + grp + (u0 + u) * kGroups), each as
// this lane's 16-byte vectors; rows past the chunk end (n) and lanes past head_dim load zeros.
template <typename L, typename T>
__device__ __forceinline__ void load_rows(uint4 (&raw)[L::kUnroll][L::kVecsPerLane], const T* base,
                                          const int32_t* bt, int c0, int n, int u0, int grp,
                                          int glane, int shift, int bmask, int64_t stride_b,
                                          int64_t stride_t) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    const int c = grp + (u0 + u) * L::kGroups;
    const int64_t off = c < n ? row_offset(bt, c0 + c, shift, bmask, stride_b, stride_t) : 0;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
      const int vi = glane + v * L::kLanes;
      raw[u][v] = make_uint4(0u, 0u, 0u, 0u);
      if (c < n && vi < L::kNumVecs)
        raw[u][v] = __ldg(reinterpret_cast<const uint4*>(base + off + vi * L::kVec));
    }
  }
}

// Attention of query token `tok` (heads head0 .. head0+num_h-1) over keys lo..hi-1. Writes the
// normalised output, or (partial) the unnormalised fp32 sum with its max and denominator.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void attend(const PagedAttentionParams& p, Shared<T, HEAD_DIM>& s,
                                       int64_t seq, int64_t tok, int head0, int num_h, int kvh,
                                       int lo, int hi, bool partial, int split) {
  using L = Layout<T, HEAD_DIM>;
  constexpr int kVec = L::kVec;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int glane = tid % L::kLanes, grp = tid / L::kLanes;
  const bool capped = p.softcap > 0.f;
  const float q_scale = capped ? p.scale : p.scale * kLog2e;

  const T* q = static_cast<const T*>(p.q);
  for (int i = tid; i < kMaxHeads * HEAD_DIM; i += kThreads) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float v = 0.f;
    if (h < num_h) v = Elem<T>::to_float(q[tok * p.q_stride_token + (head0 + h) * p.q_stride_head + d]) * q_scale;
    s.q[h][d] = v;
  }
  if (tid < kMaxHeads) {
    s.m[tid] = kNegInf;
    s.l[tid] = 0.f;
  }
  float acc[kMaxHeads][L::kVecsPerLane * kVec];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h)
#pragma unroll
    for (int e = 0; e < L::kVecsPerLane * kVec; ++e) acc[h][e] = 0.f;
  __syncthreads();

  const T* kbase = static_cast<const T*>(p.k_cache) + kvh * p.k_stride_head;
  const T* vbase = static_cast<const T*>(p.v_cache) + kvh * p.v_stride_head;
  const int32_t* bt = p.block_tables + seq * p.block_table_stride;
  const int shift = __ffs(static_cast<int>(p.block_size)) - 1;
  const int bmask = static_cast<int>(p.block_size) - 1;

  for (int c0 = lo; c0 < hi; c0 += kChunk) {
    const int n = min(kChunk, hi - c0);
    // Scores: kUnroll rows per group in flight, then the dot products and a lane reduction.
    for (int u0 = 0; u0 < L::kTokensPerGroup; u0 += L::kUnroll) {
      uint4 raw[L::kUnroll][L::kVecsPerLane];
      load_rows<L>(raw, kbase, bt, c0, n, u0, grp, glane, shift, bmask, p.k_stride_block, p.k_stride_token);
#pragma unroll
      for (int u = 0; u < L::kUnroll; ++u) {
        float sc[kMaxHeads];
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) sc[h] = 0.f;
#pragma unroll
        for (int v = 0; v < L::kVecsPerLane; ++v) {
          const int vi = glane + v * L::kLanes;
          if (vi < L::kNumVecs) {
            float kf[kVec];
            Elem<T>::unpack(raw[u][v], kf);
#pragma unroll
            for (int h = 0; h < kMaxHeads; ++h) {
              if (h >= num_h) break;  // CTA-uniform: groups under 8 heads skip the spare rows
#pragma unroll
              for (int e = 0; e < kVec; ++e) sc[h] += s.q[h][vi * kVec + e] * kf[e];
            }
          }
        }
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
          if (h >= num_h) break;  // uniform, so every lane of the warp still joins the shuffles
#pragma unroll
          for (int o = L::kLanes / 2; o > 0; o /= 2) sc[h] += __shfl_xor_sync(0xffffffffu, sc[h], o);
        }
        const int c = grp + (u0 + u) * L::kGroups;
        if (glane == 0) {
#pragma unroll
          for (int h = 0; h < kMaxHeads; ++h) {
            float x = sc[h];
            if (capped) x = p.softcap * softcap_tanh(x / p.softcap) * kLog2e;
            s.p[h][c] = c < n ? x : kNegInf;
          }
        }
      }
    }
    __syncthreads();
    // Online softmax step, one warp per head.
    for (int h = warp; h < num_h; h += kWarps) {
      float mx = kNegInf;
      for (int c = lane; c < n; c += 32) mx = fmaxf(mx, s.p[h][c]);
      mx = warp_max(mx);
      const float m_old = s.m[h];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;  // no finite score yet
      float sum = 0.f;
      for (int c = lane; c < kChunk; c += 32) {
        const float e = c < n ? exp2f(s.p[h][c] - m_use) : 0.f;
        s.p[h][c] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_use);
        s.alpha[h] = alpha;
        s.l[h] = s.l[h] * alpha + sum;
        s.m[h] = m_new;
      }
    }
    __syncthreads();
    // P.V: rescale, then add this group's rows. Rows past n are never loaded (they may be NaN).
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      const float alpha = h < num_h ? s.alpha[h] : 1.f;
#pragma unroll
      for (int e = 0; e < L::kVecsPerLane * kVec; ++e) acc[h][e] *= alpha;
    }
    for (int u0 = 0; u0 < L::kTokensPerGroup; u0 += L::kUnroll) {
      uint4 raw[L::kUnroll][L::kVecsPerLane];
      load_rows<L>(raw, vbase, bt, c0, n, u0, grp, glane, shift, bmask, p.v_stride_block, p.v_stride_token);
#pragma unroll
      for (int u = 0; u < L::kUnroll; ++u) {
        const int c = grp + (u0 + u) * L::kGroups;
        if (c >= n) continue;
#pragma unroll
        for (int v = 0; v < L::kVecsPerLane; ++v) {
          float vf[kVec];
          Elem<T>::unpack(raw[u][v], vf);
#pragma unroll
          for (int h = 0; h < kMaxHeads; ++h) {
            if (h >= num_h) break;
            const float ph = s.p[h][c];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[h][v * kVec + e] += ph * vf[e];
          }
        }
      }
    }
    __syncthreads();
  }

  // Sum the groups' partial P.V rows, then normalise (or store the partial and its stats).
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h)
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
      const int vi = glane + v * L::kLanes;
      if (vi < L::kNumVecs) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) s.red[grp][h][vi * kVec + e] = acc[h][v * kVec + e];
      }
    }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  for (int i = tid; i < num_h * HEAD_DIM; i += kThreads) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float sum = 0.f;
#pragma unroll
    for (int g = 0; g < L::kGroups; ++g) sum += s.red[g][h][d];
    const int64_t head = head0 + h;
    if (partial) {
      const int64_t row = (seq * p.num_heads + head) * p.max_splits + split;
      p.part_out[row * HEAD_DIM + d] = sum;
      if (d == 0) {
        p.part_ml[row * 2] = s.m[h];
        p.part_ml[row * 2 + 1] = s.l[h];
      }
    } else {
      // A sink adds exp(sink - max) to the denominator only (its value row is zero).
      const float l = s.l[h] + (p.sinks ? exp2f(p.sinks[head] * kLog2e - s.m[h]) : 0.f);
      out[tok * p.out_stride_token + head * p.out_stride_head + d] = Elem<T>::from_float(l > 0.f ? sum / l : 0.f);
    }
  }
  __syncthreads();
}

// grid (num_seqs, num_kv_heads * head groups, max_splits), kThreads threads. sm_90 build:
// 157-168 registers for fp16/bf16 (3 CTAs per SM), 113-124 for fp32, no spills; asking for
// 4 CTAs per SM (__launch_bounds__(kThreads, 4)) caps them at 128 with 16-32 bytes of spills,
// which only a GPU timing can judge (bench/gpu_check.sh).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) decode_kernel(const PagedAttentionParams p) {
  __shared__ Shared<T, HEAD_DIM> s;
  const int64_t seq = blockIdx.x;
  const int group = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int head_groups = (group + kMaxHeads - 1) / kMaxHeads;
  const int kvh = blockIdx.y / head_groups;
  const int head0 = kvh * group + (blockIdx.y % head_groups) * kMaxHeads;
  const int num_h = min(kMaxHeads, kvh * group + group - head0);
  const int split = blockIdx.z;

  const int q_start = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int seq_len = p.seq_lens[seq];
  const int window = p.sliding_window;
  const int lo_d = window > 0 ? max(0, seq_len - window) : 0;
  const int split_len = static_cast<int>(decode_split_len(seq_len - lo_d));
  // Clamped to the grid: only a seq_len beyond the block table (unchecked on device) exceeds it.
  const int num_splits = static_cast<int>(min(decode_num_splits(seq_len - lo_d), p.max_splits));
  // q_len == 1: this CTA's split. all_decode and q_len > 1: tokens split, split + gridDim.z, ...
  // each over all its keys (see the header).
  int t = 0, t_end = 0;
  if (q_len == 1) {
    t_end = split < num_splits ? 1 : 0;
  } else if (q_len > 1 && p.all_decode) {
    t = split;
    t_end = q_len;
  }
  for (; t < t_end; t += gridDim.z) {
    const int pos = seq_len - q_len + t;
    int lo, hi;
    if (q_len == 1) {
      lo = lo_d + split * split_len;
      hi = min(seq_len, lo + split_len);
    } else {
      lo = window > 0 ? max(0, pos - window + 1) : 0;
      hi = pos + 1;
    }
    attend<T, HEAD_DIM>(p, s, seq, q_start + t, head0, num_h, kvh, lo, hi,
                        q_len == 1 && num_splits > 1, split);
  }
}

// grid (num_seqs, num_heads), kThreads threads: merges a decode query's splits in split order.
template <typename T>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const PagedAttentionParams p) {
  const int64_t seq = blockIdx.x, head = blockIdx.y;
  const int q_start = p.cu_seqlens_q[seq];
  if (p.cu_seqlens_q[seq + 1] - q_start != 1) return;
  const int seq_len = p.seq_lens[seq];
  const int lo = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
  const int num_splits = static_cast<int>(min(decode_num_splits(seq_len - lo), p.max_splits));
  if (num_splits == 1) return;  // the decode kernel wrote the output itself
  const int64_t base = (seq * p.num_heads + head) * p.max_splits;
  float m_max = kNegInf;
  for (int i = 0; i < num_splits; ++i) m_max = fmaxf(m_max, p.part_ml[(base + i) * 2]);
  float denom = 0.f;
  for (int i = 0; i < num_splits; ++i)
    denom += exp2f(p.part_ml[(base + i) * 2] - m_max) * p.part_ml[(base + i) * 2 + 1];
  if (p.sinks) denom += exp2f(p.sinks[head] * kLog2e - m_max);
  T* out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float sum = 0.f;
    for (int i = 0; i < num_splits; ++i)
      sum += exp2f(p.part_ml[(base + i) * 2] - m_max) * p.part_out[(base + i) * p.head_dim + d];
    out[q_start * p.out_stride_token + head * p.out_stride_head + d] =
        Elem<T>::from_float(denom > 0.f ? sum / denom : 0.f);
  }
}

template <typename T, int HEAD_DIM>
Status launch(const PagedAttentionParams& p, cudaStream_t stream) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t head_groups = (group + kMaxHeads - 1) / kMaxHeads;
  const dim3 grid(static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(p.num_kv_heads * head_groups),
                  static_cast<unsigned>(p.max_splits));
  decode_kernel<T, HEAD_DIM><<<grid, kThreads, 0, stream>>>(p);
  if (p.max_splits > 1) {
    const dim3 reduce_grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_heads));
    reduce_kernel<T><<<reduce_grid, kThreads, 0, stream>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : Status::Error(cudaGetErrorString(err));
}

// One level of dispatch: head_dim for one element type.
template <typename T>
Status launch_head_dim(const PagedAttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch<T, 64>(p, stream);
    case 80: return launch<T, 80>(p, stream);
    case 96: return launch<T, 96>(p, stream);
    case 128: return launch<T, 128>(p, stream);
    case 256: return launch<T, 256>(p, stream);
    default: return Status::Error("paged_attention_decode: head_dim must be 64, 80, 96, 128 or 256");
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

Status paged_attention_decode(const PagedAttentionParams& p, void* stream) {
  if (p.num_seqs == 0) return Status::Ok();
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    return Status::Error(
        "paged_attention_decode: num_heads must be a positive multiple of num_kv_heads");
  if (p.block_size <= 0 || (p.block_size & (p.block_size - 1)) != 0)
    return Status::Error("paged_attention_decode: block_size must be a power of two");
  if (p.max_splits < 1 || p.max_splits > kDecodeMaxSplits ||
      (p.max_splits > 1 && (!p.part_out || !p.part_ml)))
    return Status::Error(
        "paged_attention_decode: max_splits out of range or split workspace missing");
  const int64_t head_groups = (p.num_heads / p.num_kv_heads + kMaxHeads - 1) / kMaxHeads;
  if (p.num_seqs > 0x7fffffff || p.num_kv_heads * head_groups > 65535 || p.num_heads > 65535)
    return Status::Error("paged_attention_decode: too many sequences or heads for one launch");
  const int64_t es = dtype_size(p.dtype);
  const int64_t strides[] = {p.k_stride_block, p.k_stride_token, p.k_stride_head, p.v_stride_block, p.v_stride_token, p.v_stride_head};
  bool ok = aligned16(p.k_cache) && aligned16(p.v_cache);
  for (int64_t st : strides) ok = ok && (st * es) % 16 == 0;
  if (!ok)
    return Status::Error(
        "paged_attention_decode: k_cache/v_cache need 16-byte aligned rows (pointer and strides)");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return launch_head_dim<float>(p, s);
    case DType::kFloat16: return launch_head_dim<__half>(p, s);
    case DType::kBFloat16: return launch_head_dim<__nv_bfloat16>(p, s);
  }
  return Status::Error("paged_attention_decode: unknown dtype");
}

}  // namespace cuda
}  // namespace cbk
