// The AVX512-VNNI body of the CPU greedy head (greedy_head.cpp's avx512_vnni compile): the three
// ISA-specific steps score_tiles and exact_logit_of on 16-lane int8 dot products.
// Internal to greedy_head.cpp's translation unit.
#pragma once

#include "greedy_head_work.h"

// The body this compile builds (see cb_kernels/isa.h): the flags of the ISA pick it.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CBK_GREEDY_HEAD_VNNI 1
#include <immintrin.h>

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wall reports as
// uninitialised: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// tile_epilogue() in 16-lane steps: the candidates leave the registers by a compress and one
// 16-lane store each (the memory form of vcompressps is microcoded on Zen 4).
inline void tile_epilogue_vnni(const Work& w, int64_t row, int64_t j0, const __m512i (&dots)[4],
                               Slice* s) {
  const GreedyHeadParams& p = w.p;
  const __m512 hs = _mm512_set1_ps(w.hscale[row]), u = _mm512_set1_ps(w.u[row]),
               v = _mm512_set1_ps(w.v[row]), pn = _mm512_set1_ps(w.pn[row]),
               qn = _mm512_set1_ps(w.qn[row]), r = _mm512_set1_ps(w.r[row]),
               tiny = _mm512_set1_ps(kTinySlack),
               none = _mm512_set1_ps(-INFINITY);
  const __m512i off = _mm512_set1_epi32(w.offset[row]);
  __m512 lo[4], hi[4];
  for (int b = 0; b < 4; ++b) {
    const int64_t j = j0 + 16 * b;
    const __m512 sj = _mm512_loadu_ps(w.scale + j), l1 = _mm512_loadu_ps(w.l1 + j),
                 l2 = _mm512_loadu_ps(w.l2 + j), err = _mm512_loadu_ps(w.err + j);
    __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dots[b], off)),
                             _mm512_mul_ps(hs, sj));
    for (int64_t e = 0; e < p.num_exact; ++e)
      a = _mm512_fmadd_ps(_mm512_set1_ps(w.hx[row * p.num_exact + e]),
                          _mm512_loadu_ps(p.exact_cols + e * w.padded_vocab + j), a);
    const __m512 bound = _mm512_add_ps(
        _mm512_add_ps(_mm512_min_ps(_mm512_mul_ps(u, l1), _mm512_mul_ps(pn, l2)),
                      _mm512_min_ps(_mm512_mul_ps(v, sj), _mm512_mul_ps(qn, err))),
        _mm512_fmadd_ps(r, l1, tiny));
    lo[b] = _mm512_sub_ps(a, bound);
    hi[b] = _mm512_add_ps(a, bound);
    if (j + 16 > p.vocab) {   // padding rows of the last tile never count
      const int64_t valid = std::max<int64_t>(0, p.vocab - j);
      const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
      lo[b] = _mm512_mask_blend_ps(keep, none, lo[b]);
      hi[b] = _mm512_mask_blend_ps(keep, none, hi[b]);
    }
  }
  float& best = s->best_lo[row];
  best = std::max(best, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(lo[0], lo[1]),
                                                           _mm512_max_ps(lo[2], lo[3]))));
  Candidates& c = s->cands[row];
  if (c.over) return;
  const __m512 floor = _mm512_set1_ps(pass1_floor(w, best));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int b = 0; b < 4; ++b) {
    const __mmask16 m = _mm512_cmp_ps_mask(hi[b], floor, _CMP_GE_OQ);
    if (m == 0) continue;
    c.reserve(16);
    const __m512i js = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j0 + 16 * b)));
    _mm512_storeu_si512(c.j.data() + c.n, _mm512_maskz_compress_epi32(m, js));
    _mm512_storeu_ps(c.hi.data() + c.n, _mm512_maskz_compress_ps(m, hi[b]));
    c.n += __builtin_popcount(m);
  }
  after_append(w, s, row);
}

// MR hidden rows x one tile: MR x 4 accumulators of 16 int32 lanes, one VNNI op per block and
// group of 4 dims; each weight vector is loaded once for the MR rows. tile: the packed tile,
// [groups][4 blocks][16 rows][4 bytes].
template <int MR>
void tile_rows_vnni(const Work& w, const uint8_t* tile, int64_t row0, int64_t j0, Slice* s) {
  // One array per block: a single [MR][4] array is too large for GCC to keep in registers.
  __m512i a0[MR], a1[MR], a2[MR], a3[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_si512();
  const int8_t* h = w.hq.data() + row0 * w.padded_hidden;
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* wg = tile + g * kTile * 4;
    const __m512i w0 = _mm512_loadu_si512(wg), w1 = _mm512_loadu_si512(wg + 64),
                  w2 = _mm512_loadu_si512(wg + 128), w3 = _mm512_loadu_si512(wg + 192);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, h + r * w.padded_hidden + 4 * g, 4);
      const __m512i x = _mm512_set1_epi32(four);
      a0[r] = _mm512_dpbusd_epi32(a0[r], w0, x);
      a1[r] = _mm512_dpbusd_epi32(a1[r], w1, x);
      a2[r] = _mm512_dpbusd_epi32(a2[r], w2, x);
      a3[r] = _mm512_dpbusd_epi32(a3[r], w3, x);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512i dots[4] = {a0[r], a1[r], a2[r], a3[r]};
    tile_epilogue_vnni(w, row0 + r, j0, dots, s);
  }
}

void tiles_vnni(const Work& w, int64_t t0, int64_t t1, Slice& s) {
  const GreedyHeadParams& p = w.p;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = p.packed + t * w.groups * kTile * 4;
    if (t + 1 < t1) _mm_prefetch(reinterpret_cast<const char*>(tile + w.groups * kTile * 4), _MM_HINT_T1);
    int64_t row = 0;
    for (; row + kRowBlock <= p.num_rows; row += kRowBlock)
      tile_rows_vnni<kRowBlock>(w, tile, row, t * kTile, &s);
    static_assert(kRowBlock == 6, "the remainder cases below assume blocks of 6 rows");
    switch (p.num_rows - row) {
      case 5: tile_rows_vnni<5>(w, tile, row, t * kTile, &s); break;
      case 4: tile_rows_vnni<4>(w, tile, row, t * kTile, &s); break;
      case 3: tile_rows_vnni<3>(w, tile, row, t * kTile, &s); break;
      case 2: tile_rows_vnni<2>(w, tile, row, t * kTile, &s); break;
      case 1: tile_rows_vnni<1>(w, tile, row, t * kTile, &s); break;
      default: break;
    }
  }
}

// exact_logit() 16 lanes at a time; h: [n rounded up to 16], zeros past n; wj: [n].
float exact_logit_avx512(const double* h, const float* wj, int64_t n) {
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    s0 = _mm512_fmadd_pd(_mm512_loadu_pd(h + k), _mm512_cvtps_pd(_mm256_loadu_ps(wj + k)), s0);
    s1 = _mm512_fmadd_pd(_mm512_loadu_pd(h + k + 8), _mm512_cvtps_pd(_mm256_loadu_ps(wj + k + 8)), s1);
  }
  if (k < n) {   // the tail: masked loads of w, zeros of h past n
    const int64_t left = n - k;
    const __mmask8 m0 = static_cast<__mmask8>(left >= 8 ? 0xff : (1u << left) - 1u);
    const __mmask8 m1 = static_cast<__mmask8>(left <= 8 ? 0 : (1u << (left - 8)) - 1u);
    s0 = _mm512_fmadd_pd(_mm512_loadu_pd(h + k), _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m0, wj + k)), s0);
    s1 = _mm512_fmadd_pd(_mm512_loadu_pd(h + k + 8),
                         _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m1, wj + k + 8)), s1);
  }
  alignas(64) double s[16];
  _mm512_store_pd(s, s0);
  _mm512_store_pd(s + 8, s1);
  return fold_sums(s);
}
#pragma GCC diagnostic pop

// The two ISA-specific steps, VNNI body.
void score_tiles(const Work& w, int64_t t0, int64_t t1, Slice& s) { tiles_vnni(w, t0, t1, s); }
float exact_logit_of(const double* h, const float* wj, int64_t n) { return exact_logit_avx512(h, wj, n); }

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
#else
#define CBK_GREEDY_HEAD_VNNI 0
#endif
