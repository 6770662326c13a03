// Fused per-row decoder-layer operations on CPU, fp32 and bf16 (see cb_kernels/elementwise.h).
//
// Why: after the linears, a decode step of a small model is dozens of tiny torch ops per layer
// (an RMSNorm is 6, the rotary embedding 12), each a few microseconds of dispatch and, for
// torch, one thread. Profiled on SmolLM2-135M (30 layers, 16 rows, 2 threads): rms_norm 28 us a
// call, silu 21 us, about 4 ms a step of elementwise work in all. Here each is one pass over the
// rows. Results agree with torch's to fp32 rounding, not bit for bit (other summation order in
// the RMSNorm, a polynomial exp in fp32 SiLU, fused multiply-adds; bf16 SiLU gives torch's bits).
// bf16 rows are widened to fp32 and each result rounded to nearest even where transformers' bf16
// op chain rounds it.
#include "cb_kernels/elementwise.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "attention_vec.h"
#include "threads.h"

namespace cbk {
namespace cpu {
// bf16 SiLU as a table: [65536], entry g = bf16(silu(x)) for the bf16 x with bits g (as fp32
// bits: the bf16 in the high half, zeros below), silu taken
// in double and rounded once to nearest even (NaN in, its quiet NaN out; -inf -> NaN, as x * 0;
// below -88.72, where torch's fp32 exp(-x) overflows, -0 as torch gives).
// Built once, by the portable compile, for every body: so each body gives the same bits.
const uint32_t* silu_bf16_table();
}  // namespace cpu

namespace CBK_CPU_NS {
namespace {

// Work below which one thread does the call: ~6 us of it (an RMSNorm or rotary element costs
// ~0.1 ns, a SiLU element ~0.7 ns with its exp, on one core of the bench machine).
constexpr int64_t kParallelElems = 1 << 16;
constexpr int64_t kParallelSiluElems = 1 << 13;
// bf16 SiLU reads a table: ~0.3 ns an element on one Zen 4 core, so 1 << 15 elements ~10 us.
constexpr int64_t kParallelSiluTableElems = 1 << 15;
// bf16 norm and rotary on the avx512_bf16 body: ~0.45 ns an element on one core (the 1B shape's
// 16-row norm, 2^15 elements, 15 us), so they split from 2^15 elements on; fp32 keeps 2^16.
constexpr int64_t kParallelBf16Elems = 1 << 15;

inline bool parallel(int64_t rows, int64_t elems, int64_t grain = kParallelElems) {
  return rows > 1 && rows * elems >= grain;
}

typedef uint32_t v8u __attribute__((vector_size(32)));

// Round to nearest even into the high 16 bits; NaN stays NaN (quiet), as float_to_bf16. VU: the
// uint32 vector of v's width.
template <typename VU, typename VF>
inline VU rne_bits(VF v) {
  const VU b = (VU)v;
  const VU r = b + 0x7fffu + ((b >> 16) & 1u);
  const VU nan = (b & 0x7fffffffu) > 0x7f800000u;
  return (nan & (b | 0x400000u)) | (~nan & r);
}

// Element access per dtype: 8 lanes or one element to and from fp32, and round(v), the fp32
// value an fp32 result has once stored in the dtype (identity for fp32). The bf16 forms place the
// rounding where transformers' bf16 ops round (each torch op on bf16 computes in fp32 and
// rounds its result), so a fused pass gives what the op chain gives up to fp32 summation order.
struct F32 {
  using T = float;
  static v8f load(const T* p) { return load8(p); }
  static void store(T* p, v8f v) { store8(p, v); }
  static float get(const T* p) { return *p; }
  static void put(T* p, float x) { *p = x; }
  static v8f round(v8f v) { return v; }
  static float round(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static v8f load(const T* p) {
#if defined(__AVX2__)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
    v8u w;
    for (int i = 0; i < 8; ++i) w[i] = static_cast<uint32_t>(p[i]) << 16;
    return (v8f)w;
#endif
  }
  static v8u rne(v8f v) { return rne_bits<v8u>(v); }
  static void store(T* p, v8f v) {
    const v8u r = rne(v) >> 16;
#if defined(__AVX2__)
    const __m256i b = (__m256i)r;      // each lane < 2^16: the unsigned pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
#else
    for (int i = 0; i < 8; ++i) p[i] = static_cast<uint16_t>(r[i]);
#endif
  }
  static float get(const T* p) { return bf16_to_float(*p); }
  static void put(T* p, float x) { *p = float_to_bf16(x); }
  static v8f round(v8f v) {
    const v8u r = rne(v) & 0xffff0000u;
    return (v8f)r;
  }
  static float round(float x) { return bf16_to_float(float_to_bf16(x)); }
};

// out = round(w * round(x * inv)) after x = round(x + residual): transformers' LlamaRMSNorm
// (fp32 norm, cast to the dtype, times the weight) behind a residual add in the dtype.
template <typename E>
void rms_row(const RmsNormParams& p, int64_t r) {
  using T = typename E::T;
  T* x = static_cast<T*>(p.x) + r * p.x_stride;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  const T* w = static_cast<const T*>(p.weight);
  const int64_t d = p.dim, d8 = d / 8 * 8;
  if (p.residual != nullptr) {
    const T* res = static_cast<const T*>(p.residual) + r * p.residual_stride;
    int64_t i = 0;
    for (; i < d8; i += 8) E::store(x + i, E::load(x + i) + E::load(res + i));
    for (; i < d; ++i) E::put(x + i, E::get(x + i) + E::get(res + i));
  }
  v8f acc0 = splat(0.0f), acc1 = splat(0.0f);
  int64_t i = 0;
  for (; i + 16 <= d8; i += 16) {
    const v8f a = E::load(x + i), b = E::load(x + i + 8);
    acc0 += a * a;
    acc1 += b * b;
  }
  for (; i < d8; i += 8) {
    const v8f a = E::load(x + i);
    acc0 += a * a;
  }
  float ss = hsum(acc0 + acc1);
  for (; i < d; ++i) ss += E::get(x + i) * E::get(x + i);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + p.eps);
  const v8f vinv = splat(inv);
  for (i = 0; i < d8; i += 8) E::store(out + i, E::load(w + i) * E::round(E::load(x + i) * vinv));
  for (; i < d; ++i) E::put(out + i, E::get(w + i) * E::round(E::get(x + i) * inv));
}

// x * sigmoid(x) with sigmoid from e = exp(-|x|) (exp8 takes arguments <= 0 only).
inline v8f silu8(v8f x) {
  const v8f ax = x < 0 ? -x : x;
  const v8f e = exp8(-ax);
  const v8f one = splat(1.0f);
  const v8f sig = x < 0 ? e / (one + e) : one / (one + e);
  return x * sig;
}

inline float silu1(float x) { return x / (1.0f + std::exp(-x)); }

// out = round(round(silu(g)) * u): transformers' act_fn(gate) * up, each op in the dtype.
template <typename E>
void silu_row(const SiluMulParams& p, int64_t r) {
  using T = typename E::T;
  const T* g = static_cast<const T*>(p.gate_up) + r * p.in_stride;
  const T* u = g + p.dim;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  int64_t i = 0;
  for (; i + 8 <= p.dim; i += 8) E::store(out + i, E::round(silu8(E::load(g + i))) * E::load(u + i));
  for (; i < p.dim; ++i) E::put(out + i, E::round(silu1(E::get(g + i))) * E::get(u + i));
}

inline float table_value(const uint32_t* table, uint16_t g) {
  float f;
  std::memcpy(&f, table + g, 4);
  return f;
}

// bf16: out = round(table[g] * u), the table holding round(silu(g)) for every bf16 g (see
// cpu::silu_bf16_table). Why: the fp32 formula's exp and divisions cost ~1.1 ns an element on
// the Zen 4 (16 lanes; 4x a copy of the bytes: SmolLM2's SiLU x up was 0.9 s of the 17.9 s
// burst); a bf16 input has only 65536 values, so its rounded SiLU is a 128 KiB table, and what
// is left is one fp32 multiply and one rounding, exact in IEEE arithmetic on every body.
// Lookups are scalar loads of fp32 bits into a buffer (a zmm gather is slower on the Zen 4: 0.52
// against 0.28 ns an element; 16-bit entries widened after the loads, 0.44).
[[maybe_unused]] void silu_row_bf16(const SiluMulParams& p, int64_t r, const uint32_t* table) {
  const uint16_t* g = static_cast<const uint16_t*>(p.gate_up) + r * p.in_stride;
  const uint16_t* u = g + p.dim;
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * p.out_stride;
  int64_t i = 0;
  for (; i + 8 <= p.dim; i += 8) {
    v8u s;
    for (int j = 0; j < 8; ++j) s[j] = table[g[i + j]];
    BF16::store(out + i, (v8f)s * BF16::load(u + i));
  }
  for (; i < p.dim; ++i) out[i] = float_to_bf16(table_value(table, g[i]) * bf16_to_float(u[i]));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
// The avx512_bf16 body's SiLU: 16 lanes, and bf16 rounding by vcvtneps2bf16 (one instruction for
// the eight integer ops of BF16::rne). Each lane computes exactly what silu8 computes (the same
// expressions, so the same contractions), and the hardware rounding is BF16::rne's for every
// value but fp32 denormals (which it flushes) and NaNs (whose payload it may change): a vector
// holding either takes the integer rounding instead. So this body's bits are the avx2 body's
// (tested); it ran bf16 SiLU at 16 x 1536 ~2x faster than the 8-lane body on the Zen 4.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16f splat16(float x) { return v16f{} + x; }

inline v16f exp16(v16f x) { return exp_poly<v16f, v16i>(x); }

inline v16f silu16(v16f x) {
  const v16f ax = x < 0 ? -x : x;
  const v16f e = exp16(-ax);
  const v16f one = splat16(1.0f);
  const v16f sig = x < 0 ? e / (one + e) : one / (one + e);
  return x * sig;
}

// Lanes whose bf16 rounding vcvtneps2bf16 does not do as BF16::rne: fp32 denormals and NaNs.
// (Compares into mask registers: the same test through vector masks cost 0.2 ns an element more.)
inline bool bf16_special(v16f v) {
  const __m512i a = _mm512_and_si512((__m512i)v, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 denormal =
      _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  return (denormal | nan) != 0;
}

inline v16u rne16(v16f v) { return rne_bits<v16u>(v); }

inline __m256i to_bf16x16(v16f v) {
  if (__builtin_expect(bf16_special(v), 0))
    return _mm512_cvtepi32_epi16((__m512i)(rne16(v) >> 16));
  return (__m256i)_mm512_cvtneps_pbh((__m512)v);
}

inline v16f from_bf16x16(__m256i h) {
  return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

struct F32x16 {
  using T = float;
  static v16f load(const T* p) { return (v16f)_mm512_loadu_ps(p); }
  static void store(T* p, v16f v) { _mm512_storeu_ps(p, (__m512)v); }
  static v16f round(v16f v) { return v; }
};

struct BF16x16 {
  using T = uint16_t;
  static v16f load(const T* p) {
    return from_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(T* p, v16f v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v));
  }
  static v16f round(v16f v) { return from_bf16x16(to_bf16x16(v)); }
};

// silu_row with 16 lanes; the last dim % 16 elements go through silu_row's own 8-lane and
// scalar steps, so every element has the avx2 body's bits.
template <typename E16, typename E>
void silu_row16(const SiluMulParams& p, int64_t r) {
  using T = typename E::T;
  const T* g = static_cast<const T*>(p.gate_up) + r * p.in_stride;
  const T* u = g + p.dim;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  int64_t i = 0;
  for (; i + 16 <= p.dim; i += 16)
    E16::store(out + i, E16::round(silu16(E16::load(g + i))) * E16::load(u + i));
  for (; i + 8 <= p.dim; i += 8) E::store(out + i, E::round(silu8(E::load(g + i))) * E::load(u + i));
  for (; i < p.dim; ++i) E::put(out + i, E::round(silu1(E::get(g + i))) * E::get(u + i));
}
#define CBK_SILU_ROW(E16, E) silu_row16<E16, E>

// silu_row_bf16 with 16 lanes; the tail through silu_row_bf16's own steps (the same bits).
void silu_row_bf16x16(const SiluMulParams& p, int64_t r, const uint32_t* table) {
  const uint16_t* g = static_cast<const uint16_t*>(p.gate_up) + r * p.in_stride;
  const uint16_t* u = g + p.dim;
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * p.out_stride;
  int64_t i = 0;
  for (; i + 16 <= p.dim; i += 16) {
    alignas(64) uint32_t s[16];
    for (int j = 0; j < 16; ++j) s[j] = table[g[i + j]];
    BF16x16::store(out + i, (v16f)_mm512_load_si512(s) * BF16x16::load(u + i));
  }
  for (; i + 8 <= p.dim; i += 8) {
    v8u s;
    for (int j = 0; j < 8; ++j) s[j] = table[g[i + j]];
    BF16::store(out + i, (v8f)s * BF16::load(u + i));
  }
  for (; i < p.dim; ++i) out[i] = float_to_bf16(table_value(table, g[i]) * bf16_to_float(u[i]));
}
#define CBK_SILU_ROW_BF16 silu_row_bf16x16
#else
#define CBK_SILU_ROW_BF16 silu_row_bf16
#define CBK_SILU_ROW(E16, E) silu_row<E>
#endif

// x = round(round(x * cos) + round(rotate_half(x) * sin)), cos and sin in the dtype, as
// transformers' apply_rotary_pos_emb computes it.
// One head's rotary from element i of its first half on: 8 lanes, then one at a time. Wider
// bodies run their own lanes first and finish here, so every element has this body's bits.
template <typename E>
void rope_head_from(typename E::T* x, const typename E::T* c, const typename E::T* s,
                    int64_t half, int64_t i) {
  for (const int64_t h8 = half / 8 * 8; i < h8; i += 8) {
    const v8f a = E::load(x + i), b = E::load(x + half + i);
    E::store(x + i, E::round(a * E::load(c + i)) - E::round(b * E::load(s + i)));
    E::store(x + half + i,
             E::round(b * E::load(c + half + i)) + E::round(a * E::load(s + half + i)));
  }
  for (; i < half; ++i) {
    const float a = E::get(x + i), b = E::get(x + half + i);
    E::put(x + i, E::round(a * E::get(c + i)) - E::round(b * E::get(s + i)));
    E::put(x + half + i, E::round(b * E::get(c + half + i)) + E::round(a * E::get(s + half + i)));
  }
}

template <typename E>
void rope_token(const RopeParams& p, int64_t t) {
  using T = typename E::T;
  const T* c = static_cast<const T*>(p.cos) + t * p.head_dim;
  const T* s = static_cast<const T*>(p.sin) + t * p.head_dim;
  for (int64_t h = 0; h < p.heads; ++h)
    rope_head_from<E>(static_cast<T*>(p.x) + t * p.token_stride + h * p.head_stride, c, s,
                      p.head_dim / 2, 0);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
// The avx512_bf16 body's bf16 RMSNorm and rotary: rms_row and rope_token with 16 lanes and the
// hardware rounding of to_bf16x16, each element through the same expressions (the sum of squares
// in the same lane partial sums: the low 8 lanes are rms_row's acc0, the high 8 its acc1), so the
// avx2 body's bits (tested). The integer rounding of BF16::store and BF16::round was most of
// their cost (bench/bench_elementwise.py; figures in bench/RESULTS.md).
inline v8f low8(v16f v) { return (v8f)_mm512_castps512_ps256((__m512)v); }
inline v8f high8(v16f v) { return (v8f)_mm512_extractf32x8_ps((__m512)v, 1); }

void rms_row_bf16x16(const RmsNormParams& p, int64_t r) {
  using E = BF16;
  using E16 = BF16x16;
  uint16_t* x = static_cast<uint16_t*>(p.x) + r * p.x_stride;
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * p.out_stride;
  const uint16_t* w = static_cast<const uint16_t*>(p.weight);
  const int64_t d = p.dim, d8 = d / 8 * 8;
  if (p.residual != nullptr) {
    const uint16_t* res = static_cast<const uint16_t*>(p.residual) + r * p.residual_stride;
    int64_t i = 0;
    for (; i + 16 <= d8; i += 16) E16::store(x + i, E16::load(x + i) + E16::load(res + i));
    for (; i < d8; i += 8) E::store(x + i, E::load(x + i) + E::load(res + i));
    for (; i < d; ++i) E::put(x + i, E::get(x + i) + E::get(res + i));
  }
  v16f acc = splat16(0.0f);
  int64_t i = 0;
  for (; i + 16 <= d8; i += 16) {
    const v16f a = E16::load(x + i);
    acc += a * a;
  }
  v8f acc0 = low8(acc);
  const v8f acc1 = high8(acc);
  for (; i < d8; i += 8) {
    const v8f a = E::load(x + i);
    acc0 += a * a;
  }
  float ss = hsum(acc0 + acc1);
  for (; i < d; ++i) ss += E::get(x + i) * E::get(x + i);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + p.eps);
  const v16f vinv16 = splat16(inv);
  const v8f vinv = splat(inv);
  for (i = 0; i + 16 <= d8; i += 16)
    E16::store(out + i, E16::load(w + i) * E16::round(E16::load(x + i) * vinv16));
  for (; i < d8; i += 8) E::store(out + i, E::load(w + i) * E::round(E::load(x + i) * vinv));
  for (; i < d; ++i) E::put(out + i, E::get(w + i) * E::round(E::get(x + i) * inv));
}

void rope_token_bf16x16(const RopeParams& p, int64_t t) {
  using E = BF16;
  using E16 = BF16x16;
  const int64_t half = p.head_dim / 2, h8 = half / 8 * 8;
  const uint16_t* c = static_cast<const uint16_t*>(p.cos) + t * p.head_dim;
  const uint16_t* s = static_cast<const uint16_t*>(p.sin) + t * p.head_dim;
  for (int64_t h = 0; h < p.heads; ++h) {
    uint16_t* x = static_cast<uint16_t*>(p.x) + t * p.token_stride + h * p.head_stride;
    int64_t i = 0;
    for (; i + 16 <= h8; i += 16) {
      const v16f a = E16::load(x + i), b = E16::load(x + half + i);
      E16::store(x + i, E16::round(a * E16::load(c + i)) - E16::round(b * E16::load(s + i)));
      E16::store(x + half + i,
                 E16::round(b * E16::load(c + half + i)) + E16::round(a * E16::load(s + half + i)));
    }
    rope_head_from<E>(x, c, s, half, i);
  }
}
#define CBK_RMS_ROW_BF16 rms_row_bf16x16
#define CBK_ROPE_TOKEN_BF16 rope_token_bf16x16
#else
#define CBK_RMS_ROW_BF16 rms_row<BF16>
#define CBK_ROPE_TOKEN_BF16 rope_token<BF16>
#endif

inline bool taken(DType t) { return t == DType::kFloat32 || t == DType::kBFloat16; }

}  // namespace

Status rms_norm(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.x_stride < p.dim || p.out_stride < p.dim ||
      (p.residual != nullptr && p.residual_stride < p.dim))
    return Status::Error("rms_norm: need rows >= 0, dim > 0 and strides >= dim");
  if (p.rows == 0) return Status::Ok();
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return Status::Error("rms_norm: null pointer");
  if (!taken(p.dtype)) return Status::Error("rms_norm: dtype must be float32 or bfloat16");
  const bool bf16 = p.dtype == DType::kBFloat16;
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) \
    if (parallel(p.rows, p.dim, bf16 ? kParallelBf16Elems : kParallelElems))
  for (int64_t r = 0; r < p.rows; ++r) bf16 ? CBK_RMS_ROW_BF16(p, r) : rms_row<F32>(p, r);
  return Status::Ok();
}

Status silu_mul(const SiluMulParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.in_stride < 2 * p.dim || p.out_stride < p.dim)
    return Status::Error("silu_mul: need rows >= 0, dim > 0, in_stride >= 2 * dim, out_stride >= dim");
  if (p.rows == 0) return Status::Ok();
  if (p.gate_up == nullptr || p.out == nullptr) return Status::Error("silu_mul: null pointer");
  if (!taken(p.dtype)) return Status::Error("silu_mul: dtype must be float32 or bfloat16");
  if (p.dtype == DType::kBFloat16) {
    const uint32_t* table = cpu::silu_bf16_table();
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel(p.rows, p.dim, kParallelSiluTableElems))
    for (int64_t r = 0; r < p.rows; ++r) CBK_SILU_ROW_BF16(p, r, table);
    return Status::Ok();
  }
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel(p.rows, p.dim, kParallelSiluElems))
  for (int64_t r = 0; r < p.rows; ++r) CBK_SILU_ROW(F32x16, F32)(p, r);
  return Status::Ok();
}

Status rope(const RopeParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0)
    return Status::Error("rope: need tokens >= 0, heads > 0 and an even head_dim > 0");
  if (p.tokens == 0) return Status::Ok();
  if (p.x == nullptr || p.cos == nullptr || p.sin == nullptr) return Status::Error("rope: null pointer");
  if (!taken(p.dtype)) return Status::Error("rope: dtype must be float32 or bfloat16");
  const bool bf16 = p.dtype == DType::kBFloat16;
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) \
    if (parallel(p.tokens, p.heads * p.head_dim, bf16 ? kParallelBf16Elems : kParallelElems))
  for (int64_t t = 0; t < p.tokens; ++t) bf16 ? CBK_ROPE_TOKEN_BF16(p, t) : rope_token<F32>(p, t);
  return Status::Ok();
}

Status rope_write_kv(const RopeWriteKvParams& p) {
  const RopeParams &q = p.q, &k = p.k;
  if (q.tokens != k.tokens || q.head_dim != k.head_dim || q.dtype != k.dtype || q.cos != k.cos ||
      q.sin != k.sin)
    return Status::Error("rope_write_kv: q and k need the same tokens, head_dim, dtype, cos and sin");
  if (q.tokens < 0 || q.heads <= 0 || k.heads <= 0 || q.head_dim <= 0 || q.head_dim % 2 != 0)
    return Status::Error("rope_write_kv: need tokens >= 0, heads > 0 and an even head_dim > 0");
  if (q.tokens == 0) return Status::Ok();
  if (q.x == nullptr || k.x == nullptr || p.value == nullptr || q.cos == nullptr ||
      q.sin == nullptr || p.k_cache == nullptr || p.v_cache == nullptr || p.slot_mapping == nullptr)
    return Status::Error("rope_write_kv: null pointer");
  if (!taken(q.dtype)) return Status::Error("rope_write_kv: dtype must be float32 or bfloat16");
  if (p.block_size <= 0) return Status::Error("rope_write_kv: block_size must be > 0");
  const bool bf16 = q.dtype == DType::kBFloat16;
  const int64_t es = dtype_size(q.dtype), row = q.head_dim * es;
  char* kc = static_cast<char*>(p.k_cache);
  char* vc = static_cast<char*>(p.v_cache);
  const char* kx = static_cast<const char*>(k.x);
  const char* vx = static_cast<const char*>(p.value);
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) \
    if (parallel(q.tokens, (q.heads + k.heads) * q.head_dim, bf16 ? kParallelBf16Elems : kParallelElems))
  for (int64_t t = 0; t < q.tokens; ++t) {
    if (bf16) {
      CBK_ROPE_TOKEN_BF16(q, t);
      CBK_ROPE_TOKEN_BF16(k, t);
    } else {
      rope_token<F32>(q, t);
      rope_token<F32>(k, t);
    }
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0 || slot >= p.num_slots) continue;
    const int64_t block = slot / p.block_size, off = slot % p.block_size;
    char* kd = kc + (block * p.k_cache_stride[0] + off * p.k_cache_stride[1]) * es;
    char* vd = vc + (block * p.v_cache_stride[0] + off * p.v_cache_stride[1]) * es;
    for (int64_t h = 0; h < k.heads; ++h) {
      std::memcpy(kd + h * p.k_cache_stride[2] * es, kx + (t * k.token_stride + h * k.head_stride) * es, row);
      std::memcpy(vd + h * p.v_cache_stride[2] * es,
                  vx + (t * p.value_token_stride + h * p.value_head_stride) * es, row);
    }
  }
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
// The run-time pick (cb_kernels/isa.h): bodies portable and avx2; silu_mul and every bf16 call
// also avx512_bf16.
#if CBK_X86_BODIES
#define CBK_DECLARE_ELEMENTWISE(ns)                    \
  namespace ns {                                      \
  Status rms_norm(const RmsNormParams& p);            \
  Status silu_mul(const SiluMulParams& p);            \
  Status rope(const RopeParams& p);                   \
  Status rope_write_kv(const RopeWriteKvParams& p);   \
  }
CBK_DECLARE_ELEMENTWISE(cpu_avx2)
CBK_DECLARE_ELEMENTWISE(cpu_avx512_bf16)
#undef CBK_DECLARE_ELEMENTWISE
#endif

namespace cpu {
namespace {
constexpr Isa kBodies[] = {Isa::kPortable, Isa::kAvx2};

// Round to the nearest bf16, ties to even, from a double in one step (not via float: two
// roundings can land on a tie the exact value is not on).
uint16_t double_to_bf16(double d) {
  if (std::isnan(d) || std::isinf(d)) return float_to_bf16(static_cast<float>(d));
  float f = static_cast<float>(d);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(bits >> 16);          // |lo| <= |d|: d truncated
  const uint16_t hi = static_cast<uint16_t>(lo + 1);              // the next bf16 away from 0
  const double below = std::fabs(d) - std::fabs(static_cast<double>(bf16_to_float(lo)));
  const double above = std::fabs(static_cast<double>(bf16_to_float(hi))) - std::fabs(d);
  if (below != above) return below < above ? lo : hi;
  return (lo & 1u) ? hi : lo;
}

std::vector<uint32_t> build_silu_bf16_table() {
  std::vector<uint32_t> t(65536);
  for (uint32_t g = 0; g < 65536; ++g) {
    const float x = bf16_to_float(static_cast<uint16_t>(g));
    if (std::isnan(x)) {
      t[g] = (g | 0x40u) << 16;
      continue;
    }
    if (x < -88.72283935546875f && !std::isinf(x)) {  // fp32 exp(-x) overflows: torch gives -0
      t[g] = 0x80000000u;
      continue;
    }
    const double e = std::exp(-std::fabs(static_cast<double>(x)));
    const double sig = x < 0 ? e / (1.0 + e) : 1.0 / (1.0 + e);
    t[g] = static_cast<uint32_t>(double_to_bf16(static_cast<double>(x) * sig)) << 16;
  }
  return t;
}
}  // namespace

const uint32_t* silu_bf16_table() {
  static const std::vector<uint32_t> table = build_silu_bf16_table();
  return table.data();
}

namespace {
// bf16 calls (and fp32 SiLU) also have an avx512_bf16 body; fp32 norms and rotary keep the
// avx2 one, whose bits the fp32 engine's tokens were checked with.
constexpr Isa kBf16Bodies[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16};

// A call's body by the run-time pick: avx512_bf16 where `wide` (the CPU has it), else avx2 or
// portable.
template <typename P>
using Body = Status (*)(const P&);
#if CBK_X86_BODIES
#define CBK_BODIES(fn) cpu_avx512_bf16::fn, cpu_avx2::fn, cpu_portable::fn
#else
#define CBK_BODIES(fn) nullptr, nullptr, cpu_portable::fn
#endif

template <typename P>
Status by_isa(const P& p, bool wide, Isa isa, Body<P> avx512_bf16, Body<P> avx2,
              Body<P> portable) {
#if CBK_X86_BODIES
  if (wide && pick(isa, kBf16Bodies) == Isa::kAvx512Bf16) return avx512_bf16(p);
  if (pick(isa, kBodies) == Isa::kAvx2) return avx2(p);
#endif
  return portable(p);
}
}  // namespace

Status rms_norm(const RmsNormParams& p, Isa isa) {
  return by_isa(p, p.dtype == DType::kBFloat16, isa, CBK_BODIES(rms_norm));
}

// 16 lanes and vcvtneps2bf16 where the CPU has AVX512-BF16, fp32 too; the avx2 body's bits (tests)
Status silu_mul(const SiluMulParams& p, Isa isa) {
  return by_isa(p, true, isa, CBK_BODIES(silu_mul));
}

Status rope(const RopeParams& p, Isa isa) {
  return by_isa(p, p.dtype == DType::kBFloat16, isa, CBK_BODIES(rope));
}

Status rope_write_kv(const RopeWriteKvParams& p, Isa isa) {
  return by_isa(p, p.q.dtype == DType::kBFloat16, isa, CBK_BODIES(rope_write_kv));
}
#undef CBK_BODIES
}  // namespace cpu
#endif

}  // namespace cbk

