// Vector building blocks of the CPU paged-attention kernel (csrc/cpu/paged_attention.cpp), also
// used by the sampling and elementwise kernels.
// Compiled once per ISA body like the kernels that include it (cb_kernels/isa.h): include it
// only from a csrc/cpu/*.cpp, which is built with CBK_CPU_NS set.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cb_kernels/common.h"

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The portable body passes 32-byte vectors between inline functions without AVX; they never
// cross an ABI boundary (all in an anonymous namespace), so GCC's ABI note is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// The tile steps (dot_block, tile_scores, pv_block, pv_rows) are forced inline: left to GCC,
// dot_block stayed out of line, zeroing its 8 accumulators with rep stos and spilling them for
// the add tree on every call, and after the shared-prefix groups made paged_attention.cpp's
// runners larger an unshared decode ran ~5-15% slower (bench_paged_attention.py groups, 1 thread).
#define CBK_VEC_INLINE inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// Lane shuffle of two vectors (indices into their concatenation): GCC before 12 only has
// __builtin_shuffle, clang only __builtin_shufflevector.
#if defined(__clang__) || __GNUC__ >= 12
#define CBK_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CBK_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

// A vector loaded once and used by several FMAs: GCC otherwise folds the load into each FMA as
// a memory operand, and Zen 4 issues two 256-bit loads per cycle against two FMAs.
inline v8f load8_reg(const float* p) {
  v8f v = load8(p);
#if defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }

inline float hmax(v8f v) {
  const v8f a = vmax(v, CBK_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  const v8f b = vmax(a, CBK_SHUFFLE(a, a, 2, 3, 0, 1, 6, 7, 4, 5));
  return std::max(b[0], b[1]);
}

inline float hsum(v8f v) {
  const v8f a = v + CBK_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8f b = a + CBK_SHUFFLE(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}

// exp(x) for x <= 0 (every caller subtracts a running max); -inf and x < -87.3 give 0.
// Cephes-style: 2^n * poly(r), relative error ~2e-7. V: a float vector type, VI: its int32 twin
// (exp8 here; elementwise.cpp's avx512_bf16 body takes 16 lanes: same steps, same bits a lane).
template <typename V, typename VI>
inline V exp_poly(V x) {
  const V lowest = V{} + -87.3f;
  const VI underflow = x < lowest;
  x = x > lowest ? x : lowest;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return underflow ? V{} : p * scale;
}

inline v8f exp8(v8f x) { return exp_poly<v8f, v8i>(x); }

// c * tanh(x / c) with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) (never overflows).
// V/VI as exp_poly (softcap8 here; the bf16 decode tile takes 16 lanes: same steps, same bits).
template <typename V, typename VI>
inline V softcap_poly(V x, float cap) {
  const V zero = V{}, one = V{} + 1.0f;
  const V y = x * (V{} + 1.0f / cap);
  const V a = y < zero ? -y : y;
  const V e = exp_poly<V, VI>((V{} + -2.0f) * a);
  const V t = (one - e) / (one + e);
  return (V{} + cap) * (y < zero ? -t : t);
}

inline v8f softcap8(v8f x, float cap) { return softcap_poly<v8f, v8i>(x, cap); }

// Scores of R query rows (q_stride floats apart) against T = 8 / R key rows, written to
// s[r * s_stride + t]; a transposing add tree turns the 8 (row, key) accumulators into one vector
// (lane r * T + t). Each K chunk loaded feeds R FMAs. Every (row, key) pair keeps
// its own lane partial sums over head_dim and goes through the same transposing add tree, so a
// score does not depend on R or on its place in the block. q: [R][q_stride]; k: [T] row
// pointers, each [dim8]; s: [R][s_stride].
template <int R>
CBK_VEC_INLINE void dot_block(const float* q, int64_t q_stride, const float* const* k, int64_t dim8,
                      float* s, int64_t s_stride) {
  constexpr int T = 8 / R;
  v8f acc[8] = {};
  for (int64_t c = 0; c < dim8; c += 8) {
    v8f qv[R];
    for (int r = 0; r < R; ++r) qv[r] = load8(q + r * q_stride + c);
    for (int t = 0; t < T; ++t) {
      const v8f kv = load8_reg(k[t] + c);
      for (int r = 0; r < R; ++r) acc[r * T + t] += qv[r] * kv;
    }
  }
#if defined(__AVX__)
  // The same sums, ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) per accumulator, in 9
  // instructions instead of 21.
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_hadd_ps(acc[2 * i], acc[2 * i + 1]);
  const __m256 y0 = _mm256_hadd_ps(x[0], x[1]), y1 = _mm256_hadd_ps(x[2], x[3]);
  const v8f z = _mm256_add_ps(_mm256_permute2f128_ps(y0, y1, 0x20),
                              _mm256_permute2f128_ps(y0, y1, 0x31));
#else
  v8f x[4];
  for (int i = 0; i < 4; ++i)
    x[i] = CBK_SHUFFLE(acc[2 * i], acc[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           CBK_SHUFFLE(acc[2 * i], acc[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f y[2];
  for (int i = 0; i < 2; ++i)
    y[i] = CBK_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           CBK_SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f z = CBK_SHUFFLE(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                CBK_SHUFFLE(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
  for (int r = 0; r < R; ++r)
    __builtin_memcpy(s + r * s_stride, reinterpret_cast<const float*>(&z) + r * T, T * 4);
}

// Software prefetch of the next tile's K/V rows into L2, issued a few cache lines at a time
// between pieces of this tile's work (one burst of a whole tile stalled the loads behind it).
struct Prefetcher {
  const char* const* k;  // [keys] row addresses of the first head
  const char* const* v;
  int64_t k_head, v_head;  // bytes from one head's row to the next
  int64_t keys, heads, row_bytes;
  int64_t key = 0, head = 0, off = 0;
  const char* kr = keys > 0 ? k[0] : nullptr;
  const char* vr = keys > 0 ? v[0] : nullptr;
  int64_t lines() const { return keys * heads * ((row_bytes + 63) / 64); }
  inline void step(int64_t n) {
    for (; n > 0 && key < keys; --n) {
      __builtin_prefetch(kr + off, 0, 1);
      __builtin_prefetch(vr + off, 0, 1);
      if ((off += 64) < row_bytes) continue;
      off = 0;
      if (++head < heads) {
        kr += k_head;
        vr += v_head;
        continue;
      }
      head = 0;
      if (++key < keys) {
        kr = k[key];
        vr = v[key];
      }
    }
  }
};

// Scores of query rows [0, rows) (dim8 floats apart) against keys [g0, g1) of a tile, S per row
// at s: blocks of two rows (4 keys per tree), a last odd row alone (8 keys per tree). g0 is a
// multiple of 4; keys up to the next multiple of 4 (8) past g1 are computed too. The prefetcher
// moves on pf_step lines per dot block. k: [S] key row pointers, each [dim8].
template <int S>
CBK_VEC_INLINE void tile_scores(const float* q, int64_t rows, const float* const* k, int g0, int g1,
                        int64_t dim8, float* s, Prefetcher& pf, int64_t pf_step) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    for (int g = g0; g < g1; g += 4, pf.step(pf_step))
      dot_block<2>(q + r * dim8, dim8, k + g, dim8, s + r * S + g, S);
  }
  if (r < rows)
    for (int g = g0 / 8 * 8; g < g1; g += 8, pf.step(pf_step))
      dot_block<1>(q + r * dim8, dim8, k + g, dim8, s + r * S + g, S);
}

// o_r[0 .. 8*NV) = o_r * alpha_r + sum_j p_r[j] * v[j][0 .. 8*NV) for R rows at once, so each V
// chunk loaded feeds R FMAs; accumulators stay in registers. A row's sums run in j order
// whatever R is.
template <int R, int NV>
CBK_VEC_INLINE void pv_block(float* o, int64_t o_stride, const float* alpha, const float* p,
                     int64_t p_stride, const float* const* v, int j0, int j1, int64_t c0) {
  v8f acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i)
      acc[r][i] = load8(o + r * o_stride + c0 + 8 * i) * splat(alpha[r]);
  for (int j = j0; j < j1; ++j) {
    v8f pj[R];
    for (int r = 0; r < R; ++r) pj[r] = splat(p[r * p_stride + j]);
    const float* vr = v[j] + c0;
    for (int i = 0; i < NV; ++i) {
      const v8f vv = load8_reg(vr + 8 * i);
      for (int r = 0; r < R; ++r) acc[r][i] += pj[r] * vv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) store8(o + r * o_stride + c0 + 8 * i, acc[r][i]);
}

// pv_block over all of head_dim. o: [R][dim8]; alpha: [R]; p: [R][p_stride]; v: [j1] row
// pointers, each [dim8].
template <int R, int NV>
CBK_VEC_INLINE void pv_rows(float* o, int64_t dim8, const float* alpha, const float* p, int64_t p_stride,
                    const float* const* v, int j0, int j1) {
  int64_t c = 0;
  for (; c + 8 * NV <= dim8; c += 8 * NV)
    pv_block<R, NV>(o, dim8, alpha, p, p_stride, v, j0, j1, c);
  if (NV > 4 && c + 32 <= dim8) {
    pv_block<R, 4>(o, dim8, alpha, p, p_stride, v, j0, j1, c);
    c += 32;
  }
  if (NV > 2 && c + 16 <= dim8) {
    pv_block<R, 2>(o, dim8, alpha, p, p_stride, v, j0, j1, c);
    c += 16;
  }
  if (NV > 1 && c + 8 <= dim8) pv_block<R, 1>(o, dim8, alpha, p, p_stride, v, j0, j1, c);
}

// Element conversions: n elements of `dtype` at src to fp32 at dst.
inline void to_float(const void* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dtype == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
    for (; i < n; ++i) dst[i] = fp16_to_float(s[i]);
  }
}

// n fp32 values at src to `dtype` at dst.
inline void from_float(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dtype == DType::kBFloat16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = float_to_fp16(src[i]);
  }
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
