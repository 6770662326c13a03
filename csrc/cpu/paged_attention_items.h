// The work items of the CPU paged attention and the steps its two item runners share (the fp32
// one in paged_attention.cpp, the AVX512-BF16 one in paged_attention_bf16.h): the plan's
// structures, per-thread scratch, the online-softmax step, the block-table walk with its
// prefetches, and the write of an item's rows. paged_attention.cpp's opening comment gives the
// design and its measurements. Internal to that file's translation unit (anonymous namespace).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_vec.h"
#include "cb_kernels/paged_attention.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

constexpr int kTile = 16;         // KV tokens per online-softmax step
constexpr int kPartition = 256;   // KV tokens per work item (a multiple of kTile)
constexpr int kSmallDim = 32;     // head_dim up to this takes the two below instead
constexpr int kSmallTile = 64;
constexpr int kSmallPartition = 512;
constexpr int kMaxRows = 64;      // query rows per work item (more when one group is larger)
constexpr int64_t kGrainWork = 4096;   // (query row, key) pairs worth a thread: ~40 us at d=64
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One unit of parallel work: rows of q tokens [i0, i1) (indices within the sequence's q range)
// times the query heads of kv heads [h0, h1), over KV positions [kv_begin, kv_end). Row r is
// kv head h0 + r / rows_per_head, then q token i0 + (r % rows_per_head) / group, then query head
// r % group of that kv head's group.
//
// A shared-prefix group (seqs > 1, fp32-math runner only): the decode rows of sequences
// [seq, seq + seqs), all kv heads, whose block tables hold positions [kv_begin = 0, kv_end) in
// the same physical blocks; each sequence then goes on over its own tail [kv_end, seq_len).
// Row (h * seqs + i) * group + gq is query head h * group + gq of sequence seq + i.
struct Item {
  int32_t seq, h0, h1, i0, i1, kv_begin, kv_end;
  int64_t partial;  // offset of this item's partial result in the workspace; -1: write `out`
  int32_t seqs = 1;
};

// Items that split one (chunk, kv heads) across partitions: first, first+stride, ...
struct Merge {
  int64_t first, stride;
  int32_t num_parts;
};

struct Plan {
  std::vector<Item> items;
  std::vector<Merge> merges;
  std::vector<float> partials;  // grows to the largest batch seen, never shrinks
  int64_t work = 0;  // sum over items of rows x keys
  // Per sequence: the prefix it reads from the same blocks as the sequence before it (0: none
  // or not groupable), and its shared-prefix group's size where it leads one (1: no group,
  // 0: inside another's).
  std::vector<int32_t> links, lead;
};

// Per-thread scratch, reused across calls: query rows, outputs, scores, K/V tiles.
struct Scratch {
  std::vector<float> buf;
  float* take(int64_t n, int64_t& used) {
    float* p = buf.data() + used;
    used += n;
    return p;
  }
};

struct Ctx {
  const PagedAttentionParams& p;
  int64_t group, dim8, esize;
  bool direct_kv;  // fp32 with head_dim % 8 == 0: tiles point into the cache itself
  int64_t k_head, v_head, k_tok, v_tok;  // bytes between kv heads, between a block's tokens
};

// The steps of run_item are inlined into it as one function was: left to GCC, its inliner
// kept fewer of them inline and prefill d 64 ran 1.28x slower.
#define CBK_ALWAYS_INLINE inline __attribute__((always_inline))

inline int64_t round8(int64_t x) { return (x + 7) / 8 * 8; }

// Offset of row r's query/output vector, in elements, for q or out strides.
inline int64_t row_offset(const Ctx& c, const Item& it, int64_t r, int64_t stride_token,
                          int64_t stride_head) {
  const int64_t per_head = (it.i1 - it.i0) * c.group, rem = r % per_head;
  const int64_t tok = c.p.cu_seqlens_q[it.seq] + it.i0 + rem / c.group;
  const int64_t head = (it.h0 + r / per_head) * c.group + rem % c.group;
  return tok * stride_token + head * stride_head;
}

// Calls f(r, tok, head) for the item's rows r in order: row_offset's token and query head, by
// nested loops instead of three divisions a row (at 63 rows an item they were ~1/5 of a bf16
// prefill call, one thread).
template <class F>
CBK_ALWAYS_INLINE void for_each_row(const Ctx& c, const Item& it, F f) {
  const int64_t tok0 = c.p.cu_seqlens_q[it.seq] + it.i0;
  int64_t r = 0;
  for (int64_t kh = it.h0; kh < it.h1; ++kh)
    for (int64_t t = tok0; t < tok0 + it.i1 - it.i0; ++t)
      for (int64_t gq = 0; gq < c.group; ++gq, ++r) f(r, t, kh * c.group + gq);
}

// An item's rows: per kv head (its q tokens x group), the kv heads, all of them; pos0: the
// position of its first q token. Both item runners (fp32 and bf16 K/V) start from it.
struct ItemRows {
  int64_t per_head, heads, rows;
  int32_t pos0;
};

inline ItemRows item_rows(const Ctx& c, const Item& it) {
  const PagedAttentionParams& p = c.p;
  ItemRows g;
  g.per_head = (it.i1 - it.i0) * c.group;
  g.heads = it.h1 - it.h0;
  g.rows = g.per_head * g.heads;
  const int32_t q_len = p.cu_seqlens_q[it.seq + 1] - p.cu_seqlens_q[it.seq];
  g.pos0 = p.seq_lens[it.seq] - q_len + it.i0;
  return g;
}

// Dot blocks an item runs a tile (pairs of rows per head, kTile / 4 key groups plus one): the
// steps its tile's prefetches are spread over.
template <int kTile>
inline int64_t prefetch_calls(const ItemRows& g) {
  return g.heads * ((g.per_head + 1) / 2) * (kTile / 4 + 1);
}

// The softmax denominator of a row of query head `head` (head_denominator) or of row r of item
// `it`: its running sum, plus the row's sink term exp(sink - max) where attention sinks are on
// (the sink's value row is zero, so only the denominator changes; max is the row's running max,
// which the sink need not raise).
inline float head_denominator(const Ctx& c, int64_t head, float m, float l) {
  return c.p.sinks == nullptr ? l : l + std::exp(c.p.sinks[head] - m);
}

inline float denominator(const Ctx& c, const Item& it, int64_t r, float m, float l) {
  const int64_t per_head = (it.i1 - it.i0) * c.group;
  return head_denominator(c, (it.h0 + r / per_head) * c.group + r % per_head % c.group, m, l);
}

// Online-softmax step of rows [r0, r1) over one tile: scores in ss become probabilities,
// alphas get the rescale of the earlier tiles, the running max and sum move on. Keys [j0, j1) of
// the tile are the ones a row at position pos sees; masking runs only where that is not the
// whole tile.
template <int kTile>
CBK_ALWAYS_INLINE void softmax_tile(const PagedAttentionParams& p, int64_t r0, int64_t r1, int64_t per_head,
                         int64_t group, int32_t pos0, int32_t t0, int32_t lo, int32_t hi,
                         float* ss, float* ms, float* ls, float* alphas) {
  for (int64_t r8 = r0; r8 < r1; r8 += 8) {
    float m_old[8], m_new[8], sums[8];
    const int64_t n = std::min<int64_t>(8, r1 - r8);
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t r = r8 + i;
      m_old[i] = m_new[i] = i < n ? ms[r] : 0.0f;
      sums[i] = 0.0f;
      if (i >= n) continue;
      const int32_t pos = pos0 + static_cast<int32_t>(r % per_head / group);
      const int32_t vlo = std::max(lo, p.sliding_window > 0 ? pos - p.sliding_window + 1 : 0);
      const int j0 = vlo - t0, j1 = std::min(hi, pos + 1) - t0;
      float* s = ss + r * kTile;
      if (j0 >= j1) {
        std::fill(s, s + kTile, 0.0f);
        continue;
      }
      v8f sc[kTile / 8];
      v8f mx = splat(kNegInf);
      const bool masked = j0 > 0 || j1 < kTile;
      for (int g = 0; g < kTile; g += 8) {
        sc[g / 8] = load8(s + g);
        if (p.softcap > 0.0f) sc[g / 8] = softcap8(sc[g / 8], p.softcap);
        if (masked) {
          const v8i lane = v8i{0, 1, 2, 3, 4, 5, 6, 7} + g;
          sc[g / 8] = (lane >= j0) & (lane < j1) ? sc[g / 8] : splat(kNegInf);
        }
        mx = vmax(mx, sc[g / 8]);
      }
      m_new[i] = std::max(m_old[i], hmax(mx));
      v8f sum = splat(0.0f);
      for (int g = 0; g < kTile; g += 8) {
        const v8f e = exp8(sc[g / 8] - splat(m_new[i]));
        store8(s + g, e);
        sum += e;
      }
      sums[i] = hsum(sum);
    }
    // A row that has seen no key yet (max still -inf) keeps alpha 1.
    const v8f mn = load8(m_new);
    const v8f a = mn == splat(kNegInf) ? splat(1.0f) : exp8(load8(m_old) - mn);
    for (int64_t i = 0; i < n; ++i) {
      alphas[r8 + i] = a[i];
      ls[r8 + i] = ls[r8 + i] * a[i] + sums[i];
      ms[r8 + i] = m_new[i];
    }
  }
}

// One item's views of the calling thread's scratch: query rows (scaled, zero-padded to dim8),
// unnormalised outputs, a tile's scores, per row the running max, running sum and this tile's
// rescale of the earlier ones, fp32 copies of fp16/bf16 K/V rows per live head, each head's K
// then V row pointers of a tile, and a row of zeros for the keys outside the item's range.
struct ItemScratch {
  float *qs, *os, *ss, *ms, *ls, *alphas, *kt, *vt, *zero;
  const float** kps;  // [heads][kTile]
  const float** vps;  // [heads][kTile]
};

// `step` heads are live at once (see the tile loop of run_item).
template <int kTile>
CBK_ALWAYS_INLINE ItemScratch take_scratch(int64_t rows, int64_t heads, int64_t step, int64_t dim8) {
  thread_local Scratch scratch;
  const int64_t need = rows * (2 * dim8 + kTile + 3) + 2 * step * kTile * dim8 + dim8;
  if (static_cast<int64_t>(scratch.buf.size()) < need) scratch.buf.resize(need);
  int64_t used = 0;
  ItemScratch s;
  s.qs = scratch.take(rows * dim8, used);
  s.os = scratch.take(rows * dim8, used);
  s.ss = scratch.take(rows * kTile, used);
  s.ms = scratch.take(rows, used);
  s.ls = scratch.take(rows, used);
  s.alphas = scratch.take(rows, used);
  s.kt = scratch.take(step * kTile * dim8, used);
  s.vt = scratch.take(step * kTile * dim8, used);
  s.zero = scratch.take(dim8, used);
  std::fill(s.zero, s.zero + dim8, 0.0f);
  thread_local std::vector<const float*> ptrs;
  if (static_cast<int64_t>(ptrs.size()) < 2 * heads * kTile) ptrs.resize(2 * heads * kTile);
  s.kps = ptrs.data();
  s.vps = s.kps + heads * kTile;
  return s;
}

// The item's query rows into s.qs (times scale, zero-padded); outputs, maxima and sums reset.
CBK_ALWAYS_INLINE void load_queries(const Ctx& c, const Item& it, int64_t rows, const ItemScratch& s) {
  const PagedAttentionParams& p = c.p;
  const char* qb = static_cast<const char*>(p.q);
  for (int64_t r = 0; r < rows; ++r) {
    float* qr = s.qs + r * c.dim8;
    to_float(qb + row_offset(c, it, r, p.q_stride_token, p.q_stride_head) * c.esize, p.dtype,
             p.head_dim, qr);
    for (int64_t d = 0; d < p.head_dim; ++d) qr[d] *= p.scale;
    std::fill(qr + p.head_dim, qr + c.dim8, 0.0f);
  }
  std::fill(s.os, s.os + rows * c.dim8, 0.0f);
  std::fill(s.ms, s.ms + rows, kNegInf);
  std::fill(s.ls, s.ls + rows, 0.0f);
}

// Calls f(k0, v0, n) for each run of positions [lo, hi) of item `at` inside one block: k0/v0
// address kv head at.h0's K/V row of the run's first position, n positions follow (k_tok bytes
// apart).
template <class F>
CBK_ALWAYS_INLINE void for_each_block_run(const Ctx& c, const Item& at, int32_t lo, int32_t hi, F f) {
  const PagedAttentionParams& p = c.p;
  const char* kb = static_cast<const char*>(p.k_cache);
  const char* vb = static_cast<const char*>(p.v_cache);
  const int32_t* table = p.block_tables + at.seq * p.block_table_stride;
  for (int32_t pos = lo; pos < hi;) {
    const int64_t block = table[pos / p.block_size];
    const int32_t off = static_cast<int32_t>(pos % p.block_size);
    const int32_t n = std::min<int32_t>(hi - pos, static_cast<int32_t>(p.block_size) - off);
    f(pos, kb + (block * p.k_stride_block + off * p.k_stride_token) * c.esize + at.h0 * c.k_head,
      vb + (block * p.v_stride_block + off * p.v_stride_token) * c.esize + at.h0 * c.v_head, n);
    pos += n;
  }
}

// Block-table walk 1: the addresses of kv head at.h0's K/V rows at positions [lo, hi) of the
// tile starting at t0 (slot pos - t0); the item's other heads are k_head/v_head bytes on.
CBK_ALWAYS_INLINE void locate_rows(const Ctx& c, const Item& at, int32_t t0, int32_t lo, int32_t hi,
                        const char** kr, const char** vr) {
  for_each_block_run(c, at, lo, hi, [&](int32_t pos, const char* k0, const char* v0, int32_t n) {
    for (int32_t i = 0; i < n; ++i) {
      kr[pos - t0 + i] = k0 + i * c.k_tok;
      vr[pos - t0 + i] = v0 + i * c.v_tok;
    }
  });
}

// Block-table walk 2: one line per 4 KiB page of positions [lo, hi) (the tile after the one
// located), so that its address translations are warm when its rows are prefetched a tile
// later. Kept apart from walk 1: one walk doing both made decode d 64 16 x 2048 ~1.13x slower
// on one thread.
CBK_ALWAYS_INLINE void warm_pages(const Ctx& c, const Item& at, int32_t lo, int32_t hi) {
  const int64_t heads = at.h1 - at.h0, row = c.p.head_dim * c.esize;
  for_each_block_run(c, at, lo, hi, [&](int32_t, const char* k0, const char* v0, int32_t n) {
    const int64_t kspan = (n - 1) * c.k_tok + (heads - 1) * c.k_head + row;
    const int64_t vspan = (n - 1) * c.v_tok + (heads - 1) * c.v_head + row;
    for (int64_t b = 0; b < kspan; b += 4096) __builtin_prefetch(k0 + b, 0, 1);
    for (int64_t b = 0; b < vspan; b += 4096) __builtin_prefetch(v0 + b, 0, 1);
    __builtin_prefetch(k0 + kspan - 1, 0, 1);
    __builtin_prefetch(v0 + vspan - 1, 0, 1);
  });
}

// The item's rows: normalised into `out`, or unnormalised with their maxima and sums into its
// partial slot for run_merge.
CBK_ALWAYS_INLINE void write_item(const Ctx& c, const Item& it, int64_t rows, const ItemScratch& s,
                                  float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim = p.head_dim, dim8 = c.dim8;
  if (it.partial < 0) {
    char* ob = static_cast<char*>(p.out);
    for_each_row(c, it, [&](int64_t r, int64_t tok, int64_t head) {
      float* o = s.os + r * dim8;
      const float inv = 1.0f / denominator(c, it, r, s.ms[r], s.ls[r]);
      for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
      from_float(o, dim, p.dtype,
                 ob + (tok * p.out_stride_token + head * p.out_stride_head) * c.esize);
    });
    return;
  }
  float* dst = partials + it.partial;  // [rows][dim] outputs, then [rows] maxima, [rows] sums
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * dim, s.os + r * dim8, dim * sizeof(float));
  std::memcpy(dst + rows * dim, s.ms, rows * sizeof(float));
  std::memcpy(dst + rows * dim + rows, s.ls, rows * sizeof(float));
}

// Walks item `it`'s kTile-key tiles: per tile, body(t0, lo, hi, krow, vrow, pf, pf_quota) with
// that tile's kv head h0 K/V row addresses (slot pos - t0; the item's keys are [lo, hi)), while
// the next tile's rows (or, on the last tile, the first tile of `next`, the item this thread
// runs next) are located and handed to the prefetcher, which the body steps pf_quota lines at a
// time (pf_calls steps a tile) between pieces of its work.
template <int kTile, class Body>
CBK_ALWAYS_INLINE void walk_tiles(const Ctx& c, const Item& it, const Item* next, int64_t pf_calls,
                                  Body body) {
  const PagedAttentionParams& p = c.p;
  const char* krow[2][kTile];  // this tile's and the next one's K/V row addresses
  const char* vrow[2][kTile];
  Prefetcher pf{nullptr, nullptr, 0, 0, 0, 0, 0};
  auto locate = [&](const Item& at, int32_t t0, const char** kr, const char** vr) {
    const int32_t lo = std::max(t0, at.kv_begin), hi = std::min(t0 + kTile, at.kv_end);
    locate_rows(c, at, t0, lo, hi, kr, vr);
    // The heads' rows of a token side by side (the usual layout): one run per token, so the
    // prefetcher's loop steps lines without per-head bookkeeping (bf16 decode at the 1B shape,
    // one thread, K/V in cache: 0.98x the time, ~the noise).
    const int64_t row = p.head_dim * c.esize, heads = at.h1 - at.h0;
    const bool runs = c.k_head == row && c.v_head == row;
    pf = Prefetcher{kr + (lo - t0), vr + (lo - t0), c.k_head, c.v_head, hi - lo,
                    runs ? 1 : heads, runs ? heads * row : row};
    warm_pages(c, at, std::max(t0 + kTile, at.kv_begin), std::min(t0 + 2 * kTile, at.kv_end));
  };
  int cur = 0;
  const int32_t first_tile = it.kv_begin / kTile * kTile;
  locate(it, first_tile, krow[0], vrow[0]);
  pf.step(pf.lines());
  for (int32_t t0 = first_tile; t0 < it.kv_end; t0 += kTile, cur ^= 1) {
    const int32_t lo = std::max(t0, it.kv_begin), hi = std::min(t0 + kTile, it.kv_end);
    if (t0 + kTile < it.kv_end)
      locate(it, t0 + kTile, krow[cur ^ 1], vrow[cur ^ 1]);
    else if (next)
      locate(*next, next->kv_begin / kTile * kTile, krow[cur ^ 1], vrow[cur ^ 1]);
    else
      pf.keys = 0;
    const int64_t pf_quota = (pf.lines() + pf_calls - 1) / pf_calls;
    body(t0, lo, hi, krow[cur], vrow[cur], pf, pf_quota);
    pf.step(pf.lines());
  }
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
