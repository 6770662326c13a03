// The vdpbf16ps building blocks of the CPU paged attention's AVX512-BF16 body: the bf16 score
// order and the two score forms that keep it, K tile transposes, P.V over key pairs, the output
// write and the item scratch. The item runners that use them are in paged_attention_bf16_items.h.
// Internal to paged_attention.cpp's translation unit.
#pragma once

#include "paged_attention_items.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// bf16 K/V with AVX512-BF16.
//
// The same items, tiles, partitions and online softmax as the fp32 runner (so the same batch
// invariance: a row's arithmetic depends on its sequence and position only), with both products on
// vdpbf16ps, which multiplies bf16 pairs and accumulates in fp32, reading K/V in place:
// - QK: each (row, key) pair accumulates 16 lanes over head_dim, 32 bf16 per instruction, and
//   the lanes fold in a fixed tree (the score order below); the scale multiplies the fp32
//   score (q stays the model's bf16 values).
// - P.V: the tile's probabilities are rounded to bf16 (as flash attention's P.V does on GPUs;
//   the running sums stay fp32) and taken in key pairs: one vpermt2w interleaves two V rows'
//   dims, one vdpbf16ps adds p_j v_j + p_(j+1) v_(j+1) for 16 dims.
// Per (key, kv head) at 4 q heads a head, d 64: 16 vdpbf16ps against 64 fp32 FMAs, and half
// the bytes. Measured in bench/RESULTS.md (paged-attention bf16 row).
using bf16_t = uint16_t;

// A bf16 pair from memory in all 16 dword lanes: one broadcast load (a 32-bit value taken
// through a general register costs a vmovd and a shuffle-unit broadcast per use).
CBK_ALWAYS_INLINE __m512bh bcast_pair(const void* p) {
  return (__m512bh)_mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(static_cast<const float*>(p))));
}

// The bf16 score order (every body below gives a score these bits): a (row, key) score
// accumulates 16 fp32 lanes over head_dim, lane l taking bf16 pairs l, l + 16, l + 32, ... with
// vdpbf16ps, in chunk order; the lanes fold as h_l = a_l + a_(l+8), then ((h0 + h1) + (h2 + h3))
// + ((h4 + h5) + (h6 + h7)); then times the scale. (The first body held the 16 lanes of one
// score in a zmm and folded them with the fp32 kernel's transposing add tree; scores_keys16 and
// scores_rows4 keep keys in lanes instead.)

// The same scores for the R <= 4 rows of one kv head (decode at a group of up to 4: one q token
// times the group), keys in lanes instead of reduced out of them. qp: the rows packed by
// pack_rows4 ([d / 32][4 sets] zmm: lane 4r + i of set t, chunk m holds row r's bf16 pair
// 16m + 4t + i). Per key, set t accumulates the pairs of the score order's lanes 4t..4t+3, in
// the same order (one 16-byte broadcast of the key per set and chunk), and the sums of the 16
// lanes fold in its tree: ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)) with h_l = a_l +
// a_(l+8). So a row gets the same bits in a decode as in a chunk of several tokens (which takes
// scores_keys16); 4 keys take 32 vdpbf16ps and 20 shuffles and adds, where the first body
// (lanes reduced per score) needed 2 calls of ~30 reduction ops each for 8.
// Keys [g0, g1) in groups of 4 from g0 (a multiple of 4; up to 3 past g1 are computed too).
CBK_ALWAYS_INLINE void pack_rows4(const bf16_t* q, int64_t q_stride, int64_t rows, int64_t d,
                                  bf16_t* qp) {
  for (int64_t m = 0; m < d / 32; ++m)
    for (int t = 0; t < 4; ++t) {
      bf16_t* dst = qp + (m * 4 + t) * 32;
      for (int r = 0; r < 4; ++r) {
        if (r < rows)
          std::memcpy(dst + 8 * r, q + r * q_stride + 32 * m + 8 * t, 16);
        else
          std::memset(dst + 8 * r, 0, 16);
      }
    }
}

// Lanes 4r + i of u0..u3 -> lane 4r + j of the result: (u_j[4r] + u_j[4r + 1]) + (u_j[4r + 2] +
// u_j[4r + 3]).
CBK_ALWAYS_INLINE __m512 fold4(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
  const __m512 a = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(u2, u3, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u2, u3, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

CBK_ALWAYS_INLINE void scores_rows4(const bf16_t* qp, int64_t rows, const bf16_t* const* k,
                                    int g0, int g1, int64_t d, float scale, float* s,
                                    int64_t s_stride, Prefetcher& pf, int64_t pf_quota) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = g0; g < g1; g += 4, pf.step(pf_quota)) {
    __m512 acc[4][4];    // [key][set]
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 4; ++t) acc[j][t] = _mm512_setzero_ps();
    for (int64_t m = 0; m < d / 32; ++m)
      for (int t = 0; t < 4; ++t) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + (m * 4 + t) * 32);
        for (int j = 0; j < 4; ++j) {
          const __m512bh kv = (__m512bh)_mm512_broadcast_i32x4(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(k[g + j] + 32 * m + 8 * t)));
          acc[j][t] = _mm512_dpbf16_ps(acc[j][t], qv, kv);
        }
      }
    // h_0..3 = sets 0 + 2, h_4..7 = sets 1 + 3 (lane l of the order is set l / 4's lane l % 4)
    __m512 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_add_ps(acc[j][0], acc[j][2]);
      hi[j] = _mm512_add_ps(acc[j][1], acc[j][3]);
    }
    const __m512 z = _mm512_mul_ps(
        _mm512_add_ps(fold4(lo[0], lo[1], lo[2], lo[3]), fold4(hi[0], hi[1], hi[2], hi[3])), sc);
    alignas(64) float out[16];
    _mm512_store_ps(out, z);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(s + r * s_stride + g, out + 4 * r, 16);
  }
}

// Prefill's scores (more than 4 rows a head): keys in lanes, in the score order above.
// transpose_tile_bf16 writes one head's tile of K as bf16 pairs, pair-major: kt[w * kTile + j] =
// pair w of key j, so that one zmm holds pair w of 16 keys. scores_keys16 then keeps, per row, the
// order's 16 lanes l as 16 vectors a_l over 16 keys: a_l accumulates pairs l, l + 16, ... in chunk
// order with the same vdpbf16ps (each lane pairs the same q and k words), and folds them in the
// order's tree before the scale. So a score has the same bits as in a decode (scores_rows4),
// while the products run without a horizontal reduction per score: 16 x 16 scores of d 64 take
// 32 vdpbf16ps and 15 adds per row, where the first body spent ~25 shuffles and adds per 8
// scores besides its 16 vdpbf16ps.
template <int kTile>
CBK_ALWAYS_INLINE void transpose_tile_bf16(const bf16_t* const* k, int64_t d, uint32_t* kt) {
  // 16 x 16 dword blocks (16 keys x 16 pairs) in four shuffle stages: 64 shuffles where
  // 512 scalar loads and stores were (one head tile of K a 16-key tile of prefill).
  for (int j0 = 0; j0 < kTile; j0 += 16)
    for (int64_t w0 = 0; w0 < d / 2; w0 += 16) {
      __m512i r[16], t[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k[j0 + j] + 2 * w0);
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {    // r[4i + m]: pair 4L + m of keys 4i..4i+3 in lane L
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      for (int m = 0; m < 4; ++m) {
        const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i u0 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i u1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], _MM_SHUFFLE(3, 1, 3, 1));
        uint32_t* dst = kt + (w0 + m) * kTile + j0;
        _mm512_storeu_si512(dst, _mm512_shuffle_i32x4(v0, u0, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(dst + 4 * kTile, _mm512_shuffle_i32x4(v1, u1, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(dst + 8 * kTile, _mm512_shuffle_i32x4(v0, u0, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_storeu_si512(dst + 12 * kTile, _mm512_shuffle_i32x4(v1, u1, _MM_SHUFFLE(3, 1, 3, 1)));
      }
    }
}

// Scores of R rows (q_stride bf16 apart) against the 16 keys whose pairs start at kt (pair w of
// key j at kt[w * kt_stride + j]), times scale, into s[r * s_stride + j].
template <int R>
CBK_ALWAYS_INLINE void scores_keys16(const bf16_t* q, int64_t q_stride, const uint32_t* kt,
                                     int64_t kt_stride, int64_t d, float scale, float* s,
                                     int64_t s_stride) {
  const int64_t chunks = d / 32;
  __m512 h[8][R];
  for (int l = 0; l < 8; ++l) {
    __m512 a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(kt + (c * 16 + l) * kt_stride);
      const __m512bh kb = (__m512bh)_mm512_loadu_si512(kt + (c * 16 + l + 8) * kt_stride);
      for (int r = 0; r < R; ++r) {
        uint32_t qa, qb;
        std::memcpy(&qa, q + r * q_stride + 32 * c + 2 * l, 4);
        std::memcpy(&qb, q + r * q_stride + 32 * c + 2 * (l + 8), 4);
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qa)), ka);
        b[r] = _mm512_dpbf16_ps(b[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qb)), kb);
      }
    }
    for (int r = 0; r < R; ++r) h[l][r] = _mm512_add_ps(a[r], b[r]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_add_ps(h[0][r], h[1][r]), _mm512_add_ps(h[2][r], h[3][r]));
    const __m512 hi = _mm512_add_ps(_mm512_add_ps(h[4][r], h[5][r]), _mm512_add_ps(h[6][r], h[7][r]));
    _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(_mm512_add_ps(lo, hi), sc));
  }
}

// Word 2i of a pair's interleaved chunk is key 2k's dim i (+ 16 for the upper half), word 2i + 1
// key 2k + 1's: what vdpbf16ps pairs with a bf16 pair (p_2k, p_2k+1).
alignas(64) static const uint16_t kPairLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                                 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13,
                                                 45, 14, 46, 15, 47};
alignas(64) static const uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                                 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                                 28, 60, 29, 61, 30, 62, 31, 63};

// P.V of R rows: o_r (fp32, [d], o_stride apart) = o_r * alpha[r * alpha_stride] + the sum over
// key pairs k in [k0, k1), in k order, of p_r,2k v_2k + p_r,2k+1 v_2k+1. vpair(c, k, lo, hi)
// sets the interleaved words of pair k for dims [c, c + 32) (from two V rows, or from a tile
// interleaved once); prob(r, k) points to row r's bf16 pair k. Whatever the sources, each output takes
// the same vdpbf16ps in the same order: the same bits for any R and either V source.
template <int R, class VPair, class Prob>
CBK_ALWAYS_INLINE void pv_pairs_bf16(float* o, int64_t o_stride, const float* alpha,
                                     int64_t alpha_stride, int k0, int k1, int64_t d,
                                     VPair vpair, Prob prob) {
  for (int64_t c = 0; c < d; c += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r * alpha_stride]);
      acc[r][0] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + c), a);
      acc[r][1] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + c + 16), a);
    }
    for (int k = k0; k < k1; ++k) {
      __m512bh lo, hi;
      vpair(c, k, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = bcast_pair(prob(r, k));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, pb);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, pb);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(o + r * o_stride + c, acc[r][0]);
      _mm512_storeu_ps(o + r * o_stride + c + 16, acc[r][1]);
    }
  }
}

// Row r's pair k at p + r * stride + k (the tile's probabilities, row-major).
struct ProbRows {
  const uint32_t* p;
  int64_t stride;
  CBK_ALWAYS_INLINE const uint32_t* operator()(int64_t r, int k) const { return p + r * stride + k; }
};

// The pair source reading an interleaved tile (interleave_tile_bf16's layout, kTile keys).
template <int kTile>
struct PairsFromTile {
  const bf16_t* vt;
  CBK_ALWAYS_INLINE void operator()(int64_t c, int k, __m512bh& lo, __m512bh& hi) const {
    const bf16_t* vc = vt + ((c / 32) * (kTile / 2) + k) * 64;
    lo = (__m512bh)_mm512_loadu_si512(vc);
    hi = (__m512bh)_mm512_loadu_si512(vc + 32);
  }
};

// The pair source reading two V rows (bf16, [d], `off` bytes past v[j]) and interleaving them.
template <class T>
struct PairsFromRows {
  const T* const* v;
  int64_t off;
  __m512i lo_idx = _mm512_load_si512(kPairLo), hi_idx = _mm512_load_si512(kPairHi);
  CBK_ALWAYS_INLINE void operator()(int64_t c, int k, __m512bh& lo, __m512bh& hi) const {
    const char* va = reinterpret_cast<const char*>(v[2 * k]) + off;
    const char* vb = reinterpret_cast<const char*>(v[2 * k + 1]) + off;
    const __m512i a = _mm512_loadu_si512(va + 2 * c);
    const __m512i b = _mm512_loadu_si512(vb + 2 * c);
    lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
    hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
  }
};

// Prefill's P.V (more than 4 rows a head): one head's V tile interleaved once for all its rows,
// instead of once per block of 4 rows (63 rows a head at a group of 3 and 21-token chunks:
// 16 times). vt[(m * kTile / 2 + i) * 64 + {0, 32}]: the lo and hi words of key pair i
// (keys 2i, 2i + 1), dims [32m, 32m + 32).
template <int kTile>
CBK_ALWAYS_INLINE void interleave_tile_bf16(const bf16_t* const* v, int64_t d, bf16_t* vt) {
  const __m512i lo_idx = _mm512_load_si512(kPairLo), hi_idx = _mm512_load_si512(kPairHi);
  for (int64_t m = 0; m < d / 32; ++m)
    for (int i = 0; i < kTile / 2; ++i) {
      const __m512i a = _mm512_loadu_si512(v[2 * i] + 32 * m);
      const __m512i b = _mm512_loadu_si512(v[2 * i + 1] + 32 * m);
      bf16_t* dst = vt + (m * kTile / 2 + i) * 64;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
}

// write_item for bf16 outputs of head_dim % 32 == 0: the normalising multiply and the rounding
// per 16 lanes, vcvtneps2bf16 where it rounds as float_to_bf16 does (every value but fp32
// denormals, which it flushes, and NaNs; a vector holding either takes float_to_bf16), so the
// bits are write_item's. The scalar loop of float_to_bf16 was ~13% of a prefill call (16 x 128
// tokens, 9 / 3 heads, d 64, one thread on the Zen 4).
CBK_ALWAYS_INLINE void write_item_bf16(const Ctx& c, const Item& it, int64_t rows,
                                       const ItemScratch& s, float* partials) {
  const PagedAttentionParams& p = c.p;
  if (it.partial >= 0 || p.dtype != DType::kBFloat16) return write_item(c, it, rows, s, partials);
  const int64_t d = p.head_dim;
  bf16_t* ob = static_cast<bf16_t*>(p.out);
  for_each_row(c, it, [&](int64_t r, int64_t tok, int64_t head) {
    const float* o = s.os + r * d;
    const __m512 inv = _mm512_set1_ps(1.0f / denominator(c, it, r, s.ms[r], s.ls[r]));
    bf16_t* dst = ob + tok * p.out_stride_token + head * p.out_stride_head;
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + i), inv);
      const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
      const __mmask16 odd =
          _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                  _mm512_set1_epi32(0x007fffff)) |
          _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
      if (__builtin_expect(odd != 0, 0)) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, v);
        for (int k = 0; k < 16; ++k) dst[i + k] = float_to_bf16(tmp[k]);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
}

// The bf16 item's scratch: q rows (bf16, [rows][d]), outputs and the softmax state as the fp32
// path (ItemScratch's os, ss, ms, ls, alphas), the tile's probabilities as bf16 pairs, per head
// the tile's K/V row pointers, and a zero row for keys outside the item's range.
struct ItemScratchBf16 {
  ItemScratch f;
  bf16_t* qs;
  uint32_t* pp;          // [rows][kTile / 2]
  const bf16_t** kps;    // [heads][kTile]
  const bf16_t** vps;
  const bf16_t* zero;
};

template <int kTile>
CBK_ALWAYS_INLINE ItemScratchBf16 take_scratch_bf16(int64_t rows, int64_t heads, int64_t d) {
  thread_local Scratch scratch;
  // floats: os rows*d, ss rows*kTile, ms/ls/alphas 3*rows, qs rows*d/2, pp rows*kTile/2, zero d/2
  const int64_t need = rows * (d + kTile + 3) + rows * d / 2 + rows * kTile / 2 + d / 2 + 16;
  if (static_cast<int64_t>(scratch.buf.size()) < need) scratch.buf.resize(need);
  int64_t used = 0;
  ItemScratchBf16 s;
  s.f.os = scratch.take(rows * d, used);
  s.f.ss = scratch.take(rows * kTile, used);
  s.f.ms = scratch.take(rows, used);
  s.f.ls = scratch.take(rows, used);
  s.f.alphas = scratch.take(rows, used);
  s.qs = reinterpret_cast<bf16_t*>(scratch.take(rows * d / 2, used));
  s.pp = reinterpret_cast<uint32_t*>(scratch.take(rows * kTile / 2, used));
  float* zero = scratch.take(d / 2, used);
  std::fill(zero, zero + d / 2, 0.0f);
  s.zero = reinterpret_cast<const bf16_t*>(zero);
  thread_local std::vector<const bf16_t*> ptrs;
  if (static_cast<int64_t>(ptrs.size()) < 2 * heads * kTile) ptrs.resize(2 * heads * kTile);
  s.kps = ptrs.data();
  s.vps = s.kps + heads * kTile;
  return s;
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
#endif  // __AVX512BF16__
