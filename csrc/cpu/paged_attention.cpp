// Paged attention on CPU (see cb_kernels/paged_attention.h for the contract).
//
// Work items are (sequence, q chunk, KV partition, kv heads [h0, h1)). A q chunk packs up to
// kMaxRows query rows per kv head (q tokens x the query heads of its group), so each K/V row is
// read from memory once for all of them; an item takes as many kv heads as fit kMaxRows rows
// (decode: all of them, reading each token's K/V rows of every head together). KV partitions are
// fixed kPartition-token ranges of absolute positions and tiles inside them fixed kTile-token
// ranges (kSmallPartition and kSmallTile at head_dim <= kSmallDim: a choice by head_dim alone);
// rows are computed in blocks whose arithmetic per row is the same either way. So how a row's
// scores are reduced depends only on its own sequence and position, never on the batch, the q
// chunking, the head grouping or the thread count. Partitions give decode with few sequences
// enough items for every thread; their partial results (unnormalised output, running max,
// running sum) are merged in a second pass.
//
// The math runs in fp32 on 8-float GCC vectors (attention_vec.h), compiled per ISA
// (cb_kernels/isa.h): 256-bit FMAs in the avx2 body, SSE pairs in the portable one. Per tile and
// kv head: scores of 2 rows x 4 keys from 8 accumulators and one transposing add tree; masking
// only in tiles cut by the causal/window edge or the item's range; the running max and rescale
// once per row and tile, 8 rows per exp8; P.V in blocks of 2 rows x 4 vectors, each V chunk
// loaded once for both rows. fp16/bf16 K/V rows are converted to fp32 scratch per tile and head,
// so the query rows sharing them pay the conversion once; fp32 rows are read in place (copying
// them too was 1.2-1.45x slower).
//
// Why these choices (2-core Zen 4 VM, fp32, 16 q / 4 kv heads, d 64, one thread, each against
// the kernel without it): each K/V chunk loaded once per row block 0.86x the time; prefetches
// spread over the tile's dot blocks instead of one burst 0.83x; all kv heads in one item reading
// whole token rows (256-byte rows 1 KiB apart read DRAM 1.5x slower); 16-key tiles 0.83-0.91x
// from DRAM against 32; one line per 4 KiB page touched a tile ahead of the row prefetches 0.90-
// 0.94x (torch puts K/V 64 bytes into a page, so a 16 KiB block spans 5 pages). Blocks of 4 rows
// were 4-17% slower at 16 keys, prefetching further ahead 0.78-0.89x against 0.75-0.81x, and an
// AVX-512 build of this file 1.06x slower (hence no avx512 body). For small heads (d 32, 8 q /
// 2 kv heads): 64-key tiles 0.81x decode / 0.89x prefill, 512-key partitions 0.95x, all heads'
// QK before the softmax before all heads' P.V 0.96x (at 16-key tiles d 64 from DRAM it was 1.2x
// slower, so those keep one head after the other), P.V in blocks of 3 rows for prefill 0.97x.
// Decode from DRAM on two threads reads K/V at 18-30 GB/s against 25 GB/s for a one-thread copy
// measured alongside, so it is bound by memory; in cache the FMAs alone take 16 of the ~44
// cycles per (key, kv head), the rest spread over the add tree, exp, prefetch and pointer setup.
#include "cb_kernels/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_vec.h"
#include "threads.h"

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
struct Item {
  int32_t seq, h0, h1, i0, i1, kv_begin, kv_end;
  int64_t partial;  // offset of this item's partial result in the workspace; -1: write `out`
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

// The softmax denominator of row r of item `it`: its running sum, plus the row's sink term
// exp(sink - max) where attention sinks are on (the sink's value row is zero, so only the
// denominator changes; max is the row's running max, which the sink need not raise).
inline float denominator(const Ctx& c, const Item& it, int64_t r, float m, float l) {
  if (c.p.sinks == nullptr) return l;
  const int64_t per_head = (it.i1 - it.i0) * c.group;
  const int64_t head = (it.h0 + r / per_head) * c.group + r % per_head % c.group;
  return l + std::exp(c.p.sinks[head] - m);
}

// Online-softmax step of rows [r0, r1) over one tile: scores in ss become probabilities,
// alphas get the rescale of the earlier tiles, the running max and sum move on. Keys [j0, j1) of
// the tile are the ones a row at position pos sees; masking runs only where that is not the
// whole tile.
template <int kTile>
inline void softmax_tile(const PagedAttentionParams& p, int64_t r0, int64_t r1, int64_t per_head,
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

// Each head's K/V row pointers of one tile for heads [hb, he): into the cache itself
// (direct_kv) or to fp32 copies in kt/vt; keys outside [jl, jh) point at zeros.
template <int kTile>
CBK_ALWAYS_INLINE void gather_tile(const Ctx& c, const char* const* krow, const char* const* vrow,
                        int64_t hb, int64_t he, int jl, int jh, const ItemScratch& s) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim = p.head_dim, dim8 = c.dim8;
  for (int64_t h = hb; h < he; ++h) {
    const float** kp = s.kps + h * kTile;
    const float** vp = s.vps + h * kTile;
    for (int j = 0; j < kTile; ++j)
      if (j < jl || j >= jh) kp[j] = vp[j] = s.zero;
    for (int j = jl; j < jh; ++j) {
      const char* kr = krow[j] + h * c.k_head;
      const char* vr = vrow[j] + h * c.v_head;
      if (c.direct_kv) {
        kp[j] = reinterpret_cast<const float*>(kr);
        vp[j] = reinterpret_cast<const float*>(vr);
      } else {
        float* kd = s.kt + ((h - hb) * kTile + j) * dim8;
        float* vd = s.vt + ((h - hb) * kTile + j) * dim8;
        to_float(kr, p.dtype, dim, kd);
        to_float(vr, p.dtype, dim, vd);
        std::fill(kd + dim, kd + dim8, 0.0f);
        std::fill(vd + dim, vd + dim8, 0.0f);
        kp[j] = kd;
        vp[j] = vd;
      }
    }
  }
}

// P.V of one head's rows [h * per_head, (h + 1) * per_head) over keys [jl, jh) of the tile.
// Blocks of 3 rows load each V chunk for 12 FMAs (prefill at d 32: 0.97x the time); a row's sums
// run in the same order in any block, so this choice may depend on the item.
template <int kTile>
CBK_ALWAYS_INLINE void pv_head(const ItemScratch& s, int64_t dim8, int64_t per_head, int64_t h, int jl,
                    int jh, Prefetcher& pf, int64_t pf_quota) {
  const float* const* vp = s.vps + h * kTile;
  const int64_t r1 = (h + 1) * per_head;
  int64_t r = h * per_head;
  if (dim8 == 32 && per_head > 4)
    for (; r + 3 <= r1; r += 3, pf.step(pf_quota))
      pv_rows<3, 4>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
  for (; r + 2 <= r1; r += 2, pf.step(pf_quota))
    pv_rows<2, 4>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
  if (r < r1)
    pv_rows<1, 8>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
}

// The item's rows: normalised into `out`, or unnormalised with their maxima and sums into its
// partial slot for run_merge.
CBK_ALWAYS_INLINE void write_item(const Ctx& c, const Item& it, int64_t rows, const ItemScratch& s,
                                  float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim = p.head_dim, dim8 = c.dim8;
  if (it.partial < 0) {
    char* ob = static_cast<char*>(p.out);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = s.os + r * dim8;
      const float inv = 1.0f / denominator(c, it, r, s.ms[r], s.ls[r]);
      for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
      from_float(o, dim, p.dtype,
                 ob + row_offset(c, it, r, p.out_stride_token, p.out_stride_head) * c.esize);
    }
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
    pf = Prefetcher{kr + (lo - t0), vr + (lo - t0), c.k_head, c.v_head, hi - lo, at.h1 - at.h0,
                    p.head_dim * c.esize};
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

// One item: per tile, gather the K/V rows, QK scores, online softmax, P.V; meanwhile the next
// tile's rows (or, on the last tile, the first tile of `next`, the item this thread runs next)
// are prefetched in memory order, a few lines per dot block. Blocks come in random order, which
// the hardware prefetcher does not follow: without this, decode 16 x 2048 took 1.9x as long on
// one thread.
template <int kTile>
void run_item(const Ctx& c, const Item& it, const Item* next, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim8 = c.dim8, group = c.group;
  const ItemRows g = item_rows(c, it);
  const int64_t per_head = g.per_head, heads = g.heads, rows = g.rows;
  const int32_t pos0 = g.pos0;
  // With 64-key tiles all heads' scores, then all rows' softmax, then all heads' P.V: the
  // heads' chains of work are independent and overlap where one head's QK -> softmax -> P.V
  // would wait (decode d 32: 0.96x the time). At 16-key tiles (d > 32) one head after the
  // other: the order over all heads read d 64 from DRAM 1.2x slower.
  const int64_t step = kTile == kSmallTile ? heads : 1;
  const ItemScratch s = take_scratch<kTile>(rows, heads, step, dim8);
  load_queries(c, it, rows, s);
  // Prefetch steps per tile: one per QK dot block and per PV row pair, for every head.
  const int64_t pf_calls = prefetch_calls<kTile>(g);
  walk_tiles<kTile>(c, it, next, pf_calls, [&](int32_t t0, int32_t lo, int32_t hi,
                                               const char* const* krow, const char* const* vrow,
                                               Prefetcher& pf, int64_t pf_quota) {
    const int jl = lo - t0, jh = hi - t0;  // the tile's keys inside this item's range
    for (int64_t hb = 0; hb < heads; hb += step) {
      const int64_t he = hb + step;
      gather_tile<kTile>(c, krow, vrow, hb, he, jl, jh, s);
      for (int64_t h = hb; h < he; ++h)
        tile_scores<kTile>(s.qs + h * per_head * dim8, per_head, s.kps + h * kTile, jl / 4 * 4,
                           jh, dim8, s.ss + h * per_head * kTile, pf, pf_quota);
      softmax_tile<kTile>(p, hb * per_head, he * per_head, per_head, group, pos0, t0, lo, hi,
                          s.ss, s.ms, s.ls, s.alphas);
      for (int64_t h = hb; h < he; ++h) pv_head<kTile>(s, dim8, per_head, h, jl, jh, pf, pf_quota);
    }
  });
  write_item(c, it, rows, s, partials);
}

#if defined(__AVX512BF16__)
// ---- bf16 K/V with AVX512-BF16 (this file's avx512_bf16 body; bf16 with head_dim % 32 == 0).
//
// The same items, tiles, partitions and online softmax as above (so the same batch invariance:
// a row's arithmetic depends on its sequence and position only), with both products on
// vdpbf16ps, which multiplies bf16 pairs and accumulates in fp32, reading K/V in place:
// - QK: each (row, key) pair accumulates 16 lanes over head_dim, 32 bf16 per instruction;
//   the lanes fold to 8 and go through the fp32 kernel's transposing add tree; the scale
//   multiplies the fp32 score (q stays the model's bf16 values).
// - P.V: the tile's probabilities are rounded to bf16 (as flash attention's P.V does on GPUs;
//   the running sums stay fp32) and taken in key pairs: one vpermt2w interleaves two V rows'
//   dims, one vdpbf16ps adds p_j v_j + p_(j+1) v_(j+1) for 16 dims.
// Per (key, kv head) at 4 q heads a head, d 64: 16 vdpbf16ps against 64 fp32 FMAs, and half
// the bytes. Measured in bench/RESULTS.md (paged-attention bf16 row).
using bf16_t = uint16_t;

// Scores of R rows (q_stride bf16 apart) against T = 8 / R keys, times scale, into
// s[r * s_stride + t]. k: [T] key rows, each [d] (d % 32 == 0).
template <int R>
CBK_ALWAYS_INLINE void dot_block_bf16(const bf16_t* q, int64_t q_stride, const bf16_t* const* k,
                                      int64_t d, float scale, float* s, int64_t s_stride) {
  constexpr int T = 8 / R;
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512bh qv[R];
    for (int r = 0; r < R; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(q + r * q_stride + c);
    for (int t = 0; t < T; ++t) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k[t] + c);
      for (int r = 0; r < R; ++r) acc[r * T + t] = _mm512_dpbf16_ps(acc[r * T + t], qv[r], kv);
    }
  }
  __m256 h[8];
  for (int i = 0; i < 8; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1));
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_hadd_ps(h[2 * i], h[2 * i + 1]);
  const __m256 y0 = _mm256_hadd_ps(x[0], x[1]), y1 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 z = _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(y0, y1, 0x20),
                                               _mm256_permute2f128_ps(y0, y1, 0x31)),
                                 _mm256_set1_ps(scale));
  for (int r = 0; r < R; ++r)
    __builtin_memcpy(s + r * s_stride, reinterpret_cast<const float*>(&z) + r * T, T * 4);
}

// o_r (fp32, [d]) = o_r * alpha_r + sum over key pairs of p_r,j v_j + p_r,j+1 v_j+1, keys
// [j0, j1) (both even), for R rows. pp: per row the tile's probabilities as bf16 pairs
// (pp_stride pairs apart); v: key rows [d] bf16.
template <int R>
CBK_ALWAYS_INLINE void pv_rows_bf16(float* o, int64_t o_stride, const float* alpha,
                                    const uint32_t* pp, int64_t pp_stride,
                                    const bf16_t* const* v, int j0, int j1, int64_t d) {
  // Word 2i of the result is a's word i (+ 16 for the upper half), word 2i + 1 is b's.
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  for (int64_t c = 0; c < d; c += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      acc[r][0] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + c), a);
      acc[r][1] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + c + 16), a);
    }
    for (int j = j0; j < j1; j += 2) {
      const __m512i a = _mm512_loadu_si512(v[j] + c), b = _mm512_loadu_si512(v[j + 1] + c);
      const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
      const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * pp_stride + j / 2]));
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

template <int kTile>
void run_item_bf16(const Ctx& c, const Item& it, const Item* next, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t d = p.head_dim, group = c.group;
  const ItemRows g = item_rows(c, it);
  const int64_t per_head = g.per_head, heads = g.heads, rows = g.rows;
  const int32_t pos0 = g.pos0;
  ItemScratchBf16 s = take_scratch_bf16<kTile>(rows, heads, d);
  const bf16_t* qb = static_cast<const bf16_t*>(p.q);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(s.qs + r * d, qb + row_offset(c, it, r, p.q_stride_token, p.q_stride_head),
                d * sizeof(bf16_t));
  std::fill(s.f.os, s.f.os + rows * d, 0.0f);
  std::fill(s.f.ms, s.f.ms + rows, kNegInf);
  std::fill(s.f.ls, s.f.ls + rows, 0.0f);

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
      int64_t r = 0;
      for (; r + 2 <= per_head; r += 2)
        for (int g = jl / 4 * 4; g < jh; g += 4, pf.step(pf_quota))
          dot_block_bf16<2>(q + r * d, d, kp + g, d, p.scale, ss + r * kTile + g, kTile);
      if (r < per_head)
        for (int g = jl / 8 * 8; g < jh; g += 8, pf.step(pf_quota))
          dot_block_bf16<1>(q + r * d, d, kp + g, d, p.scale, ss + r * kTile + g, kTile);
      softmax_tile<kTile>(p, r0, r1, per_head, group, pos0, t0, lo, hi, s.f.ss, s.f.ms, s.f.ls,
                          s.f.alphas);
      for (int64_t rr = r0; rr < r1; ++rr) {
        const float* pr = s.f.ss + rr * kTile;
        uint32_t* dst = s.pp + rr * (kTile / 2);
        for (int g = 0; g < kTile; g += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g / 2),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pr + g)));
      }
      const int pj0 = jl / 2 * 2, pj1 = (jh + 1) / 2 * 2;
      int64_t rb = r0;
      for (; rb + 4 <= r1; rb += 4, pf.step(pf_quota))
        pv_rows_bf16<4>(s.f.os + rb * d, d, s.f.alphas + rb, s.pp + rb * (kTile / 2), kTile / 2,
                        vp, pj0, pj1, d);
      for (; rb < r1; ++rb, pf.step(pf_quota))
        pv_rows_bf16<1>(s.f.os + rb * d, d, s.f.alphas + rb, s.pp + rb * (kTile / 2), kTile / 2,
                        vp, pj0, pj1, d);
    }
  });
  write_item(c, it, rows, s.f, partials);
}
#endif  // __AVX512BF16__

// The partials of one (q chunk, kv heads) over its partitions into `out`; acc: [head_dim] scratch.
void run_merge(const Ctx& c, const Plan& plan, const Merge& mg, float* acc) {
  const PagedAttentionParams& p = c.p;
  const Item& first = plan.items[mg.first];
  const int64_t dim = p.head_dim;
  const int64_t rows = (first.i1 - first.i0) * c.group * (first.h1 - first.h0);
  char* ob = static_cast<char*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (int32_t k = 0; k < mg.num_parts; ++k) {
      const float* part = plan.partials.data() + plan.items[mg.first + k * mg.stride].partial;
      m = std::max(m, part[rows * dim + r]);
    }
    float l = 0.0f;
    std::fill(acc, acc + dim, 0.0f);
    for (int32_t k = 0; k < mg.num_parts; ++k) {
      const float* part = plan.partials.data() + plan.items[mg.first + k * mg.stride].partial;
      const float w = std::exp(part[rows * dim + r] - m);
      l += w * part[rows * dim + rows + r];
      for (int64_t d = 0; d < dim; ++d) acc[d] += w * part[r * dim + d];
    }
    const float inv = 1.0f / denominator(c, first, r, m, l);
    for (int64_t d = 0; d < dim; ++d) acc[d] *= inv;
    from_float(acc, dim, p.dtype,
               ob + row_offset(c, first, r, p.out_stride_token, p.out_stride_head) * c.esize);
  }
}

// Calls f(seq, i0, i1, lo, hi) for every q chunk: q tokens [i0, i1) of sequence seq, which see
// KV positions [lo, hi).
template <class F>
void for_each_chunk(const PagedAttentionParams& p, int64_t group, F f) {
  const int32_t chunk = static_cast<int32_t>(std::max<int64_t>(1, kMaxRows / group));
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t q_len = p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s];
    const int32_t seq_len = p.seq_lens[s];
    for (int32_t i0 = 0; i0 < q_len; i0 += chunk) {
      const int32_t i1 = std::min(q_len, i0 + chunk);
      const int32_t first_pos = seq_len - q_len + i0;
      const int32_t lo = p.sliding_window > 0 ? std::max(0, first_pos - p.sliding_window + 1) : 0;
      f(s, i0, i1, lo, seq_len - q_len + i1);
    }
  }
}

// Splits the batch into items, ordered (sequence, q chunk, partition, kv heads). An item takes
// as many kv heads as fit kMaxRows rows: decode then reads each token's K/V rows of all heads
// together (1 KiB runs at 4 kv heads x 64 fp32) instead of 256-byte rows 1 KiB apart, which
// read DRAM ~1.5x slower on one core (measured without compute: 30 against 20 ns per key and
// head). Fewer heads per item when there would be under 4 items per thread.
void make_plan(const PagedAttentionParams& p, int64_t group, int threads, Plan& plan) {
  plan.items.clear();
  plan.merges.clear();
  plan.work = 0;
  const int64_t heads = p.num_kv_heads;
  auto fit = [&](int32_t i0, int32_t i1) {
    return std::max<int64_t>(1, kMaxRows / ((i1 - i0) * group));
  };
  const int32_t part = p.head_dim <= kSmallDim ? kSmallPartition : kPartition;
  auto parts_of = [part](int32_t lo, int32_t hi) {
    return (hi - 1) / part - lo / part + 1;
  };
  for_each_chunk(p, group, [&](int32_t, int32_t i0, int32_t i1, int32_t lo, int32_t hi) {
    plan.work += (i1 - i0) * group * (hi - lo) * heads;
  });
  const int64_t busy = std::min<int64_t>(threads, std::max<int64_t>(1, plan.work / kGrainWork));
  int64_t cap = heads;
  for (; cap > 1; cap = (cap + 1) / 2) {
    int64_t count = 0;
    for_each_chunk(p, group, [&](int32_t, int32_t i0, int32_t i1, int32_t lo, int32_t hi) {
      const int64_t per = std::min(cap, fit(i0, i1));
      count += parts_of(lo, hi) * ((heads + per - 1) / per);
    });
    if (count >= 4 * busy) break;
  }
  int64_t offset = 0;
  for_each_chunk(p, group, [&](int32_t s, int32_t i0, int32_t i1, int32_t lo, int32_t hi) {
    const int32_t k0 = lo / part, k1 = (hi - 1) / part, parts = k1 - k0 + 1;
    const int32_t per = static_cast<int32_t>(std::min(cap, fit(i0, i1)));
    const int32_t groups = static_cast<int32_t>((heads + per - 1) / per);
    for (int32_t g = 0; parts > 1 && g < groups; ++g)
      plan.merges.push_back({static_cast<int64_t>(plan.items.size()) + g, groups, parts});
    for (int32_t k = k0; k <= k1; ++k) {
      const int32_t end =
          static_cast<int32_t>(std::min<int64_t>(hi, (k + 1) * int64_t{part}));
      for (int32_t h0 = 0; h0 < heads; h0 += per) {
        const int32_t h1 = static_cast<int32_t>(std::min<int64_t>(heads, h0 + per));
        Item it{s, h0, h1, i0, i1, std::max(lo, k * part), end, -1};
        if (parts > 1) {
          it.partial = offset;
          offset += (i1 - i0) * group * (h1 - h0) * (p.head_dim + 2);
        }
        plan.items.push_back(it);
      }
    }
  });
  if (static_cast<int64_t>(plan.partials.size()) < offset) plan.partials.resize(offset);
}

}  // namespace

Status paged_attention(const PagedAttentionParams& p) {
  if (p.num_tokens == 0 || p.num_seqs == 0) return Status::Ok();
  if (!p.q || !p.k_cache || !p.v_cache || !p.block_tables || !p.seq_lens || !p.cu_seqlens_q ||
      !p.out)
    return Status::Error("paged_attention: a tensor pointer is null");
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 || p.block_size <= 0 ||
      p.num_heads % p.num_kv_heads != 0)
    return Status::Error("paged_attention: invalid head counts, head_dim or block_size");
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t esize = dtype_size(p.dtype);
  const Ctx c{p, group, round8(p.head_dim), esize,
              p.dtype == DType::kFloat32 && p.head_dim % 8 == 0, p.k_stride_head * esize,
              p.v_stride_head * esize, p.k_stride_token * esize, p.v_stride_token * esize};

#if defined(__AVX512BF16__)
  // This body's bf16 kernel takes bf16 with head_dim % 32 == 0 (the dispatcher sends it only
  // those); anything else runs the fp32-math kernel compiled for this ISA.
  const bool bf16_body = p.dtype == DType::kBFloat16 && p.head_dim % 32 == 0;
#endif
  // The calling thread's plan, reused so a warm call allocates nothing. Bound to a reference:
  // inside the parallel region the name of a thread_local would mean each worker's own copy.
  static thread_local Plan caller_plan;
  Plan& plan = caller_plan;
  // Small calls stay on one thread: a parallel region costs ~5 us idle and, when the machine is
  // oversubscribed, waits for a descheduled worker (a 1-token decode took 33 ms on 2 threads
  // against 7 us on one, on the shared 2-core box).
  make_plan(p, group, cpu::max_threads(), plan);
  float* partials = plan.partials.data();
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t num_merges = static_cast<int64_t>(plan.merges.size());
  const int threads = static_cast<int>(
      std::min<int64_t>(cpu::max_threads(), std::max<int64_t>(1, plan.work / kGrainWork)));
  // Items are handed out one at a time, each thread claiming its next item before it runs the
  // current one, so the current item's last tile can prefetch the next one's first.
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int64_t i = next_item.fetch_add(1, std::memory_order_relaxed);
    while (i < num_items) {
      const int64_t n = next_item.fetch_add(1, std::memory_order_relaxed);
      const Item* nx = n < num_items ? &plan.items[n] : nullptr;
#if defined(__AVX512BF16__)
      if (bf16_body && p.head_dim <= kSmallDim)
        run_item_bf16<kSmallTile>(c, plan.items[i], nx, partials);
      else if (bf16_body)
        run_item_bf16<kTile>(c, plan.items[i], nx, partials);
      else
#endif
      if (p.head_dim <= kSmallDim)
        run_item<kSmallTile>(c, plan.items[i], nx, partials);
      else
        run_item<kTile>(c, plan.items[i], nx, partials);
      i = n;
    }
    if (num_merges > 0) {
#pragma omp barrier
      thread_local std::vector<float> acc;
      if (static_cast<int64_t>(acc.size()) < p.head_dim) acc.resize(p.head_dim);
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < num_merges; ++i) run_merge(c, plan, plan.merges[i], acc.data());
    }
  }
  return Status::Ok();
}

}  // namespace CBK_CPU_NS
}  // namespace cbk

