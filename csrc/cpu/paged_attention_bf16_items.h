// The AVX512-BF16 item runners of the CPU paged attention (paged_attention.cpp's avx512_bf16
// body runs them for bf16 K/V with head_dim % 32 == 0): decode items of 16-key tiles with the
// scores and the online softmax in registers, and the general item (prefill chunks, 64-key
// tiles). The vdpbf16ps building blocks and the bf16 score order are in paged_attention_bf16.h.
// Internal to that file's translation unit.
#pragma once

#include "paged_attention_bf16.h"

#if defined(__AVX512BF16__)
namespace cbk {
namespace CBK_CPU_NS {
namespace {

// Decode rows with 16-key tiles (up to 4 rows a head: one q token times a group of up to 4):
// one head's tile with its scores kept in registers, rows in lanes: z[g] lane 4r + i is row r's
// score of key 4g + i, as scores_rows4 folds them. The online-softmax step runs on those four
// zmm (16 lanes, each row's four lanes holding its max and sum) instead of storing the scores
// and running softmax_tile's 8-lane loop over each row; the same operations per value in the
// same order (max, exp_poly, the sum tree of softmax_tile's hsum, alpha, l * alpha + sum), so
// the same bits as softmax_tile, and scores_rows4's, so a row keeps the bits of a chunk.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// A tile's per-row visible keys [j0, j1) as lanes 4r + i (rows >= R see none) and whether any
// row of the R sees less than the whole tile.
struct TileMask {
  __m512i j0, j1;
  bool masked;
};

template <int R>
CBK_ALWAYS_INLINE TileMask tile_mask(const PagedAttentionParams& p, int64_t group, int32_t pos0,
                                     int32_t t0, int32_t lo, int32_t hi) {
  alignas(64) int32_t a[16], b[16];
  bool masked = false;
  for (int r = 0; r < 4; ++r) {
    int32_t j0 = 0, j1 = 0;
    if (r < R) {
      const int32_t pos = pos0 + static_cast<int32_t>(r / group);
      const int32_t vlo = std::max(lo, p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0);
      j0 = vlo - t0;
      j1 = std::min(hi, pos + 1) - t0;
      masked |= j0 > 0 || j1 < 16;
    }
    for (int i = 0; i < 4; ++i) {
      a[4 * r + i] = j0;
      b[4 * r + i] = j1;
    }
  }
  return TileMask{_mm512_load_si512(a), _mm512_load_si512(b), masked};
}

// One head's R rows over one tile: scores of keys [g0, g1) (groups of 4 from g0, a multiple of
// 4) against the rows packed at qp, kr[j] + koff addressing key j's K row (vr/voff its V row;
// zero rows for keys outside the item's range); the online-softmax state of the 4 rows in
// ml (lanes 4r + i: 16 running maxima, then 16 running sums); P.V into o ([R][d]).
template <int R>
CBK_ALWAYS_INLINE void decode_tile_bf16(const PagedAttentionParams& p, const bf16_t* qp,
                                        const char* const* kr, int64_t koff,
                                        const char* const* vr, int64_t voff, int g0, int g1,
                                        int k0, int k1, const TileMask& tm, float* ml, float* o,
                                        Prefetcher& pf, int64_t pf_quota) {
  const int64_t d = p.head_dim;
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 z[4];
  for (int q4 = 0; q4 < 4; ++q4) {
    const int g = 4 * q4;
    if (g < g0 || g >= g1) {
      z[q4] = ninf;
      continue;
    }
    __m512 acc[4][4];    // [key][set], as scores_rows4
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 4; ++t) acc[j][t] = _mm512_setzero_ps();
    for (int64_t m = 0; m < d / 32; ++m)
      for (int t = 0; t < 4; ++t) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + (m * 4 + t) * 32);
        for (int j = 0; j < 4; ++j) {
          const __m512bh kv = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(kr[g + j] + koff + 2 * (32 * m + 8 * t))));
          acc[j][t] = _mm512_dpbf16_ps(acc[j][t], qv, kv);
        }
      }
    __m512 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_add_ps(acc[j][0], acc[j][2]);
      hi[j] = _mm512_add_ps(acc[j][1], acc[j][3]);
    }
    z[q4] = _mm512_mul_ps(
        _mm512_add_ps(fold4(lo[0], lo[1], lo[2], lo[3]), fold4(hi[0], hi[1], hi[2], hi[3])),
        _mm512_set1_ps(p.scale));
    pf.step(pf_quota * ((R + 1) / 2));
  }
  // softmax_tile's step on 16 lanes: softcap, then the mask, then max, exp, sum.
  const __m512i lane = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
  for (int q4 = 0; q4 < 4; ++q4) {
    if (p.softcap > 0.0f) {
      v16f v = (v16f)z[q4];
      z[q4] = (__m512)softcap_poly<v16f, v16i>(v, p.softcap);
    }
    if (tm.masked) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(4 * q4));
      const __mmask16 in = _mm512_cmpge_epi32_mask(key, tm.j0) & _mm512_cmplt_epi32_mask(key, tm.j1);
      z[q4] = _mm512_mask_mov_ps(ninf, in, z[q4]);
    }
  }
  __m512 mx = _mm512_max_ps(_mm512_max_ps(z[0], z[1]), _mm512_max_ps(z[2], z[3]));
  mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, _MM_SHUFFLE(2, 3, 0, 1)));
  mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 m_old = _mm512_loadu_ps(ml);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  // A row that has seen no key yet (max still -inf): probabilities 0, alpha 1.
  const __mmask16 dead = _mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ);
  const v16f m_sub = (v16f)_mm512_mask_mov_ps(m_new, dead, _mm512_setzero_ps());
  v16f e[4];
  for (int q4 = 0; q4 < 4; ++q4) e[q4] = exp_poly<v16f, v16i>((v16f)z[q4] - m_sub);
  // softmax_tile's hsum: (e_j + e_j+8), then + the one 4 keys on, then pairs, then the two.
  const v16f a4 = (e[0] + e[2]) + (e[1] + e[3]);
  const __m512 a = (__m512)a4;
  const __m512 b = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 sum = _mm512_add_ps(b, _mm512_permute_ps(b, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 alpha = _mm512_mask_mov_ps(
      (__m512)exp_poly<v16f, v16i>((v16f)m_old - (v16f)m_new), dead, _mm512_set1_ps(1.0f));
  const v16f l_new = (v16f)_mm512_loadu_ps(ml + 16) * (v16f)alpha + (v16f)sum;
  _mm512_storeu_ps(ml, m_new);
  _mm512_storeu_ps(ml + 16, (__m512)l_new);
  // P as bf16: dword 2r + h of group q4 is row r's key pair 2 q4 + h.
  alignas(64) uint32_t pp[32];
  for (int q4 = 0; q4 < 4; ++q4)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp + 8 * q4),
                       (__m256i)_mm512_cvtneps_pbh((__m512)e[q4]));
  alignas(64) float al[16];
  _mm512_store_ps(al, alpha);
  pv_pairs_bf16<R>(o, d, al, 4, k0, k1, d, PairsFromRows<char>{vr, voff},
                   [&](int64_t r, int k) { return pp + (k >> 1) * 8 + 2 * r + (k & 1); });
  pf.step(pf_quota);
}

// Head h's K/V rows of a 16-key tile as the runners read them: row j at k[j] + koff (v[j] +
// voff). A whole tile reads the cache rows themselves (koff/voff: the head's offset); a tile cut
// by the item's range [jl, jh) reads kz/vz, filled with the head's rows inside the range and
// `zero` (a zero row) outside it.
struct HeadRows {
  const char* const* k;
  const char* const* v;
  int64_t koff, voff;
};

CBK_ALWAYS_INLINE HeadRows head_rows(const Ctx& c, const char* const* krow,
                                     const char* const* vrow, int64_t h, int jl, int jh,
                                     bool whole, const void* zero, const char** kz,
                                     const char** vz) {
  const int64_t koff = h * c.k_head, voff = h * c.v_head;
  if (whole) return HeadRows{krow, vrow, koff, voff};
  const char* z = static_cast<const char*>(zero);
  for (int j = 0; j < 16; ++j) {
    const bool in = j >= jl && j < jh;
    kz[j] = in ? krow[j] + koff : z;
    vz[j] = in ? vrow[j] + voff : z;
  }
  return HeadRows{kz, vz, 0, 0};
}

// The decode item of 16-key tiles and up to 4 rows a head (decode_tile_bf16 per head and tile).
template <int R>
void run_item_decode_bf16(const Ctx& c, const Item& it, const Item* next, const ItemRows& g,
                          const ItemScratchBf16& s, const bf16_t* qpack, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t d = p.head_dim, heads = g.heads;
  thread_local std::vector<float> state;     // per head: 16 maxima, 16 sums
  if (static_cast<int64_t>(state.size()) < heads * 32) state.resize(heads * 32);
  float* ml = state.data();
  for (int64_t h = 0; h < heads; ++h) {
    std::fill(ml + h * 32, ml + h * 32 + 16, kNegInf);
    std::fill(ml + h * 32 + 16, ml + h * 32 + 32, 0.0f);
  }
  const int64_t pf_calls = prefetch_calls<16>(g);
  walk_tiles<16>(c, it, next, pf_calls, [&](int32_t t0, int32_t lo, int32_t hi,
                                            const char* const* krow, const char* const* vrow,
                                            Prefetcher& pf, int64_t pf_quota) {
    const int jl = lo - t0, jh = hi - t0;
    const TileMask tm = tile_mask<R>(p, c.group, g.pos0, t0, lo, hi);
    const bool whole = jl == 0 && jh == 16;
    const char* kz[16];
    const char* vz[16];
    for (int64_t h = 0; h < heads; ++h) {
      const HeadRows hr = head_rows(c, krow, vrow, h, jl, jh, whole, s.zero, kz, vz);
      const char* const* kr = hr.k;
      const char* const* vr = hr.v;
      const int64_t koff = hr.koff, voff = hr.voff;
      decode_tile_bf16<R>(p, qpack + h * 4 * d, kr, koff, vr, voff, jl / 4 * 4, jh, jl / 2,
                          (jh + 1) / 2, tm, ml + h * 32, s.f.os + h * R * d, pf, pf_quota);
    }
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int r = 0; r < R; ++r) {
      s.f.ms[h * R + r] = ml[h * 32 + 4 * r];
      s.f.ls[h * R + r] = ml[h * 32 + 16 + 4 * r];
    }
  write_item_bf16(c, it, g.rows, s.f, partials);
}

// Prefill items of 16-key tiles (more than 4 rows a head), rows in lanes: a head's rows in
// blocks of 16, the q pairs of a block transposed once per item (qt[w]: pair w of its 16 rows)
// and each K pair broadcast from the cache, so one q load serves 4 keys and no K tile is
// transposed. Scores keep the bf16 score order (per (row, key) the 16 lane sums a_l over pairs
// l, l + 16, ..., folded in its tree), so a row has the bits it gets in a decode; the online
// softmax then runs on 16 rows at once (a key's scores are one zmm: max, exp and the sum tree
// of softmax_tile's hsum are lane-wise), and P goes to P.V as pairs of keys per row.
struct BlockMask {
  __m512i j0, j1;    // lane r: row r's visible keys [j0, j1) of the tile
  bool masked;
};

// A block's rows once per item: lane r holds row r's position (padding rows: the first row's)
// and `valid` its real rows, so a tile's mask is a few vector ops (computing it per row and
// tile, with a division by the group each, was ~1/4 of a prefill call).
struct BlockRows {
  __m512i pos;
  __mmask16 valid;
};

// Row r of a head (q token r / group) in lane r % 16 of block r / 16, counted without a division.
inline void block_rows(int64_t group, int64_t per_head, int64_t blocks, int32_t pos0,
                       BlockRows* br) {
  alignas(64) int32_t a[16];
  int32_t pos = pos0;
  int64_t gq = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    __mmask16 valid = 0;
    for (int i = 0; i < 16; ++i) {
      if (16 * b + i >= per_head) {
        a[i] = pos0;
        continue;
      }
      a[i] = pos;
      valid |= static_cast<__mmask16>(1u << i);
      if (++gq == group) {
        gq = 0;
        ++pos;
      }
    }
    br[b] = BlockRows{_mm512_load_si512(a), valid};
  }
}

// Row r sees keys [max(lo, pos - W + 1), min(hi, pos + 1)) of the tile at t0 (softmax_tile's
// bounds); masked: some real row sees less than the whole tile.
CBK_ALWAYS_INLINE BlockMask block_mask(const PagedAttentionParams& p, const BlockRows& br,
                                       int32_t t0, int32_t lo, int32_t hi) {
  __m512i vlo = _mm512_set1_epi32(lo);
  if (p.sliding_window > 0)
    vlo = _mm512_max_epi32(vlo, _mm512_sub_epi32(br.pos, _mm512_set1_epi32(p.sliding_window - 1)));
  const __m512i j1 = _mm512_sub_epi32(
      _mm512_min_epi32(_mm512_set1_epi32(hi), _mm512_add_epi32(br.pos, _mm512_set1_epi32(1))),
      _mm512_set1_epi32(t0));
  const __m512i j0 = _mm512_sub_epi32(vlo, _mm512_set1_epi32(t0));
  const __mmask16 part = _mm512_cmpgt_epi32_mask(j0, _mm512_setzero_si512()) |
                         _mm512_cmplt_epi32_mask(j1, _mm512_set1_epi32(16));
  return BlockMask{j0, j1, (part & br.valid) != 0};
}

// Scores of one block's 16 rows (qt: [d / 2] zmm of row pairs) against keys [j, j + NK) (K
// rows at k[j] + koff), times scale, into st[j]: [16 keys][16 rows]. Per key the 16 lane sums
// a_l and the fold of the score order, h_l = a_l + a_(l+8) taken two by two as they come.
// 8 keys a call (each q load feeds 8 vdpbf16ps): prefill 16 x 128, 9 / 3 heads, one thread,
// 0.88-0.91x the old body's time, against 0.89-1.01x at 4 keys, 1.03-1.09x at 2, 1.2x at 1.
template <int NK>
CBK_ALWAYS_INLINE void block_scores(const uint32_t* qt, const char* const* k, int64_t koff, int j,
                                    int64_t d, float scale, float* st) {
  const int64_t chunks = d / 32;
  const char* kr[NK];
  for (int t = 0; t < NK; ++t) kr[t] = k[j + t] + koff;
  __m512 part[NK][2];    // [key]: (h0 + h1) + (h2 + h3), then the same of h4..h7
  for (int half = 0; half < 2; ++half) {
    __m512 pair[NK][2];
    for (int l2 = 0; l2 < 4; l2 += 2) {
      __m512 h[NK][2];
      for (int u = 0; u < 2; ++u) {
        const int l = 4 * half + l2 + u;
        __m512 a[NK], b[NK];
        for (int t = 0; t < NK; ++t) a[t] = b[t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512bh qa = (__m512bh)_mm512_loadu_si512(qt + (16 * c + l) * 16);
          const __m512bh qb = (__m512bh)_mm512_loadu_si512(qt + (16 * c + l + 8) * 16);
          for (int t = 0; t < NK; ++t) {
            a[t] = _mm512_dpbf16_ps(a[t], qa, bcast_pair(kr[t] + 4 * (16 * c + l)));
            b[t] = _mm512_dpbf16_ps(b[t], qb, bcast_pair(kr[t] + 4 * (16 * c + l + 8)));
          }
        }
        for (int t = 0; t < NK; ++t) h[t][u] = _mm512_add_ps(a[t], b[t]);
      }
      for (int t = 0; t < NK; ++t) pair[t][l2 / 2] = _mm512_add_ps(h[t][0], h[t][1]);
    }
    for (int t = 0; t < NK; ++t) part[t][half] = _mm512_add_ps(pair[t][0], pair[t][1]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int t = 0; t < NK; ++t)
    _mm512_storeu_ps(st + (j + t) * 16, _mm512_mul_ps(_mm512_add_ps(part[t][0], part[t][1]), sc));
}

// The online-softmax step of one block over the tile (scores st[j][row]); ml: the block's
// running max (16 lanes) then running sum; alphas: its rows' rescale; pk[k][row]: the bf16
// pair of keys 2k, 2k + 1 of each row.
CBK_ALWAYS_INLINE void block_softmax(const PagedAttentionParams& p, const BlockMask& bm,
                                     const float* st, float* ml, float* alphas, uint32_t* pk) {
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  v16f z[16];
  __m512 mx = ninf;
  for (int j = 0; j < 16; ++j) {
    __m512 v = _mm512_loadu_ps(st + j * 16);
    if (p.softcap > 0.0f) v = (__m512)softcap_poly<v16f, v16i>((v16f)v, p.softcap);
    if (bm.masked) {
      const __m512i key = _mm512_set1_epi32(j);
      const __mmask16 in =
          _mm512_cmple_epi32_mask(bm.j0, key) & _mm512_cmpgt_epi32_mask(bm.j1, key);
      v = _mm512_mask_mov_ps(ninf, in, v);
    }
    mx = _mm512_max_ps(mx, v);
    z[j] = (v16f)v;
  }
  const __m512 m_old = _mm512_loadu_ps(ml);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  const __mmask16 dead = _mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ);
  const v16f m_sub = (v16f)_mm512_mask_mov_ps(m_new, dead, _mm512_setzero_ps());
  for (int j = 0; j < 16; ++j) z[j] = exp_poly<v16f, v16i>(z[j] - m_sub);
  v16f s8[8];
  for (int j = 0; j < 8; ++j) s8[j] = z[j] + z[j + 8];
  const v16f sum = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
  const __m512 alpha = _mm512_mask_mov_ps(
      (__m512)exp_poly<v16f, v16i>((v16f)m_old - (v16f)m_new), dead, _mm512_set1_ps(1.0f));
  const v16f l_new = (v16f)_mm512_loadu_ps(ml + 16) * (v16f)alpha + sum;
  _mm512_storeu_ps(ml, m_new);
  _mm512_storeu_ps(ml + 16, (__m512)l_new);
  _mm512_storeu_ps(alphas, alpha);
  alignas(64) static const uint16_t kZip[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,
                                                7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13,
                                                29, 14, 30, 15, 31};
  const __m512i zip = _mm512_load_si512(kZip);
  for (int k = 0; k < 8; ++k)
    _mm512_storeu_si512(pk + 16 * k, _mm512_permutexvar_epi16(
        zip, (__m512i)_mm512_cvtne2ps_pbh((__m512)z[2 * k + 1], (__m512)z[2 * k])));
}

// Row r's pair k at p + k * 16 + r (block_softmax's pk).
struct ProbCols {
  const uint32_t* p;
  CBK_ALWAYS_INLINE const uint32_t* operator()(int64_t r, int k) const { return p + k * 16 + r; }
};

void run_item_prefill_bf16(const Ctx& c, const Item& it, const Item* next, const ItemRows& g,
                           const ItemScratchBf16& s, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t d = p.head_dim, heads = g.heads, per_head = g.per_head;
  const int64_t blocks = (per_head + 15) / 16;
  thread_local std::vector<uint32_t> qt, pk, vt;
  thread_local std::vector<float> ml, st, al;
  thread_local std::vector<BlockMask> bms;     // per block, the tile's visible keys of its rows
  thread_local std::vector<BlockRows> brs;
  if (static_cast<int64_t>(bms.size()) < blocks) {
    bms.resize(blocks);
    brs.resize(blocks);
  }
  block_rows(c.group, per_head, blocks, g.pos0, brs.data());
  if (static_cast<int64_t>(qt.size()) < heads * blocks * d * 8) qt.resize(heads * blocks * d * 8);
  if (static_cast<int64_t>(ml.size()) < heads * blocks * 32) {
    ml.resize(heads * blocks * 32);
    al.resize(heads * blocks * 16);
  }
  if (static_cast<int64_t>(pk.size()) < blocks * 128) pk.resize(blocks * 128);
  if (static_cast<int64_t>(vt.size()) < d * 8) vt.resize(d * 8);
  st.resize(256);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t b = 0; b < blocks; ++b) {
      const bf16_t* rows[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t r = 16 * b + i;
        rows[i] = r < per_head ? s.qs + (h * per_head + r) * d : s.zero;
      }
      transpose_tile_bf16<16>(rows, d, qt.data() + (h * blocks + b) * d * 8);
      float* m = ml.data() + (h * blocks + b) * 32;
      std::fill(m, m + 16, kNegInf);
      std::fill(m + 16, m + 32, 0.0f);
    }
  const int64_t pf_calls = prefetch_calls<16>(g);
  walk_tiles<16>(c, it, next, pf_calls, [&](int32_t t0, int32_t lo, int32_t hi,
                                            const char* const* krow, const char* const* vrow,
                                            Prefetcher& pf, int64_t pf_quota) {
    const int jl = lo - t0, jh = hi - t0;
    const bool whole = jl == 0 && jh == 16;
    const char* kz[16];
    const char* vz[16];
    for (int64_t b = 0; b < blocks; ++b)
      bms[b] = block_mask(p, brs[b], t0, lo, hi);
    for (int64_t h = 0; h < heads; ++h) {
      const HeadRows hr = head_rows(c, krow, vrow, h, jl, jh, whole, s.zero, kz, vz);
      const char* const* kr = hr.k;
      const char* const* vr = hr.v;
      const int64_t koff = hr.koff, voff = hr.voff;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint32_t* q = qt.data() + (h * blocks + b) * d * 8;
        for (int j = jl / 8 * 8; j < jh; j += 8, pf.step(16 * pf_quota))
          block_scores<8>(q, kr, koff, j, d, p.scale, st.data());
        block_softmax(p, bms[b], st.data(), ml.data() + (h * blocks + b) * 32,
                      al.data() + (h * blocks + b) * 16, pk.data() + b * 128);
      }
      // P.V: V tile interleaved once, then rows in blocks of 4 (inside a block of 16).
      const bf16_t* vp[16];
      for (int j = 0; j < 16; ++j) vp[j] = reinterpret_cast<const bf16_t*>(vr[j] + voff);
      interleave_tile_bf16<16>(vp, d, reinterpret_cast<bf16_t*>(vt.data()));
      const PairsFromTile<16> tile{reinterpret_cast<const bf16_t*>(vt.data())};
      const int k0 = jl / 2, k1 = (jh + 1) / 2;
      float* o = s.f.os + h * per_head * d;
      const float* alpha = al.data() + h * blocks * 16;
      int64_t r = 0;
      for (; r + 4 <= per_head; r += 4, pf.step(pf_quota))
        pv_pairs_bf16<4>(o + r * d, d, alpha + r, 1, k0, k1, d, tile,
                         ProbCols{pk.data() + (r / 16) * 128 + r % 16});
      for (; r < per_head; ++r, pf.step(pf_quota))
        pv_pairs_bf16<1>(o + r * d, d, alpha + r, 1, k0, k1, d, tile,
                         ProbCols{pk.data() + (r / 16) * 128 + r % 16});
    }
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < per_head; ++r) {
      const float* m = ml.data() + (h * blocks + r / 16) * 32;
      s.f.ms[h * per_head + r] = m[r % 16];
      s.f.ls[h * per_head + r] = m[16 + r % 16];
    }
  write_item_bf16(c, it, g.rows, s.f, partials);
}

template <int kTile>
void run_item_bf16(const Ctx& c, const Item& it, const Item* next, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t d = p.head_dim, group = c.group;
  const ItemRows g = item_rows(c, it);
  const int64_t per_head = g.per_head, heads = g.heads, rows = g.rows;
  const int32_t pos0 = g.pos0;
  ItemScratchBf16 s = take_scratch_bf16<kTile>(rows, heads, d);
  const bf16_t* qb = static_cast<const bf16_t*>(p.q);
  // d % 32 == 0: whole zmm (a memcpy call a row was ~5%)
  for_each_row(c, it, [&](int64_t r, int64_t tok, int64_t head) {
    const bf16_t* src = qb + tok * p.q_stride_token + head * p.q_stride_head;
    for (int64_t i = 0; i < d; i += 32)
      _mm512_storeu_si512(s.qs + r * d + i, _mm512_loadu_si512(src + i));
  });
  std::fill(s.f.os, s.f.os + rows * d, 0.0f);
  std::fill(s.f.ms, s.f.ms + rows, kNegInf);
  std::fill(s.f.ls, s.f.ls + rows, 0.0f);

  // Up to 4 rows a head (decode at a group of up to 4): keys-in-lanes scores (scores_rows4),
  // from each head's rows packed once for the item.
  const bool rows4 = per_head <= 4;
  thread_local std::vector<bf16_t> qpack;
  if (rows4) {
    if (static_cast<int64_t>(qpack.size()) < heads * 4 * d) qpack.resize(heads * 4 * d);
    for (int64_t h = 0; h < heads; ++h)
      pack_rows4(s.qs + h * per_head * d, d, per_head, d, qpack.data() + h * 4 * d);
    if (kTile == 16) {
      switch (per_head) {
        case 1: return run_item_decode_bf16<1>(c, it, next, g, s, qpack.data(), partials);
        case 2: return run_item_decode_bf16<2>(c, it, next, g, s, qpack.data(), partials);
        case 3: return run_item_decode_bf16<3>(c, it, next, g, s, qpack.data(), partials);
        default: return run_item_decode_bf16<4>(c, it, next, g, s, qpack.data(), partials);
      }
    }
  }
  if (!rows4 && kTile == 16) return run_item_prefill_bf16(c, it, next, g, s, partials);
  thread_local std::vector<uint32_t> kt;    // one head's K tile, pair-major (prefill)
  thread_local std::vector<bf16_t> vt;      // one head's V tile, interleaved (prefill)
  if (!rows4 && static_cast<int64_t>(kt.size()) < d / 2 * kTile) {
    kt.resize(d / 2 * kTile);
    vt.resize(d * kTile);
  }
  const int64_t pf_calls = prefetch_calls<kTile>(g);
  walk_tiles<kTile>(c, it, next, pf_calls, [&](int32_t t0, int32_t lo, int32_t hi,
                                               const char* const* krow, const char* const* vrow,
                                               Prefetcher& pf, int64_t pf_quota) {
    const int jl = lo - t0, jh = hi - t0;
    for (int64_t h = 0; h < heads; ++h) {
      const bf16_t** kp = s.kps + h * kTile;
      const bf16_t** vp = s.vps + h * kTile;
      for (int j = 0; j < kTile; ++j) {
        const bool in = j >= jl && j < jh;
        kp[j] = in ? reinterpret_cast<const bf16_t*>(krow[j] + h * c.k_head) : s.zero;
        vp[j] = in ? reinterpret_cast<const bf16_t*>(vrow[j] + h * c.v_head) : s.zero;
      }
      const int64_t r0 = h * per_head, r1 = r0 + per_head;
      const bf16_t* q = s.qs + r0 * d;
      float* ss = s.f.ss + r0 * kTile;
      if (rows4) {    // as many prefetch steps as the dot blocks of 2 rows it replaces
        scores_rows4(qpack.data() + h * 4 * d, per_head, kp, jl / 4 * 4, jh, d, p.scale, ss,
                     kTile, pf, pf_quota * ((per_head + 1) / 2));
      } else {        // and here as the dot blocks of 2 rows x 4 keys
        transpose_tile_bf16<kTile>(kp, d, kt.data());
        for (int g = jl / 16 * 16; g < jh; g += 16) {
          int64_t r = 0;
          for (; r + 2 <= per_head; r += 2, pf.step(4 * pf_quota))
            scores_keys16<2>(q + r * d, d, kt.data() + g, kTile, d, p.scale, ss + r * kTile + g,
                             kTile);
          if (r < per_head)
            scores_keys16<1>(q + r * d, d, kt.data() + g, kTile, d, p.scale, ss + r * kTile + g,
                             kTile);
        }
      }
      softmax_tile<kTile>(p, r0, r1, per_head, group, pos0, t0, lo, hi, s.f.ss, s.f.ms, s.f.ls,
                          s.f.alphas);
      for (int64_t rr = r0; rr < r1; ++rr) {
        const float* pr = s.f.ss + rr * kTile;
        uint32_t* dst = s.pp + rr * (kTile / 2);
        for (int g = 0; g < kTile; g += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g / 2),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pr + g)));
      }
      const int k0 = jl / 2, k1 = (jh + 1) / 2;   // key pairs; a pair's key outside is zero
      const int64_t ps = kTile / 2;
      int64_t rb = r0;
      if (!rows4) {
        interleave_tile_bf16<kTile>(vp, d, vt.data());
        const PairsFromTile<kTile> tile{vt.data()};
        for (; rb + 4 <= r1; rb += 4, pf.step(pf_quota))
          pv_pairs_bf16<4>(s.f.os + rb * d, d, s.f.alphas + rb, 1, k0, k1, d, tile,
                           ProbRows{s.pp + rb * ps, ps});
        for (; rb < r1; ++rb, pf.step(pf_quota))
          pv_pairs_bf16<1>(s.f.os + rb * d, d, s.f.alphas + rb, 1, k0, k1, d, tile,
                           ProbRows{s.pp + rb * ps, ps});
      }
      const PairsFromRows<bf16_t> rows_v{vp, 0};
      for (; rb + 4 <= r1; rb += 4, pf.step(pf_quota))
        pv_pairs_bf16<4>(s.f.os + rb * d, d, s.f.alphas + rb, 1, k0, k1, d, rows_v,
                         ProbRows{s.pp + rb * ps, ps});
      for (; rb < r1; ++rb, pf.step(pf_quota))
        pv_pairs_bf16<1>(s.f.os + rb * d, d, s.f.alphas + rb, 1, k0, k1, d, rows_v,
                         ProbRows{s.pp + rb * ps, ps});
    }
  });
  write_item_bf16(c, it, rows, s.f, partials);
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
#endif  // __AVX512BF16__
