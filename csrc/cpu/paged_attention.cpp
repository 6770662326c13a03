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
//
// Shared-prefix groups (run_group): the n samples of a prompt hold its full blocks in common
// (BlockManager.fork) and sit side by side in the batch, so the plan compares each decode row's
// table with the row before and makes runs of rows that begin with the same physical blocks one
// item: each tile of the common prefix is read once and scored against every row of the run
// (24 rows a kv head for SmolLM2's 3-query-head groups at n=8, against 3 alone), then each row
// goes on over its own tail tiles. The prefix is cut to a tile edge, so every row sees the same
// tiles in the same order as alone: the same bits (tests/ops/test_paged_attention_groups.py).
// Measured (Zen 4, fp32 SmolLM2 shape, 512 rows of 64 prompts x 8, contexts ~45, 2 threads):
// the engine step's attention 30-31 ms against 41-45 ms; at ~70-token contexts 66 against 70 ms
// (the private tails, read from DRAM, dominate there).
//
// The shared steps live in paged_attention_items.h, the AVX512-BF16 runners in
// paged_attention_bf16_items.h (their vdpbf16ps building blocks in paged_attention_bf16.h); this
// file holds the fp32-math runner, the merge, the plan and the entry.
#include "cb_kernels/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "paged_attention_bf16_items.h"
#include "paged_attention_items.h"
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

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

// P.V of rows [r, r1), all of kv head h's, over keys [jl, jh) of the tile. Blocks of 3 rows load
// each V chunk for 12 FMAs (prefill at d 32: 0.97x the time); a row's sums run in the same order
// in any block, so this choice may depend on the item.
template <int kTile>
CBK_ALWAYS_INLINE void pv_span(const ItemScratch& s, int64_t dim8, int64_t r, int64_t r1, int64_t h,
                               int jl, int jh, Prefetcher& pf, int64_t pf_quota) {
  const float* const* vp = s.vps + h * kTile;
  if (dim8 == 32 && r1 - r > 4)
    for (; r + 3 <= r1; r += 3, pf.step(pf_quota))
      pv_rows<3, 4>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
  for (; r + 2 <= r1; r += 2, pf.step(pf_quota))
    pv_rows<2, 4>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
  if (r < r1)
    pv_rows<1, 8>(s.os + r * dim8, dim8, s.alphas + r, s.ss + r * kTile, kTile, vp, jl, jh);
}

// One tile of rows laid out per head (head h's rows [h * per_head, (h + 1) * per_head) from
// `first` on): gather the K/V rows, QK scores, online softmax, P.V, `step` heads at a time.
// pos0: the position of the rows' first q token (see softmax_tile).
template <int kTile>
CBK_ALWAYS_INLINE void tile_step(const Ctx& c, const ItemScratch& s, int64_t heads, int64_t step,
                                 int64_t per_head, int64_t stride, int64_t first, int32_t pos0,
                                 int32_t t0, int32_t lo, int32_t hi, const char* const* krow,
                                 const char* const* vrow, Prefetcher& pf, int64_t pf_quota) {
  const int64_t dim8 = c.dim8;
  const int jl = lo - t0, jh = hi - t0;  // the tile's keys inside this item's range
  for (int64_t hb = 0; hb < heads; hb += step) {
    const int64_t he = hb + step;
    gather_tile<kTile>(c, krow, vrow, hb, he, jl, jh, s);
    for (int64_t h = hb; h < he; ++h) {
      const int64_t r0 = first + h * stride;
      tile_scores<kTile>(s.qs + r0 * dim8, per_head, s.kps + h * kTile, jl / 4 * 4, jh, dim8,
                         s.ss + r0 * kTile, pf, pf_quota);
    }
    // One call over the heads' rows where they follow each other (a row's result does not
    // depend on the rows beside it in softmax_tile's blocks of 8).
    for (int64_t h = hb; h < he; h += stride == per_head ? he - hb : 1) {
      const int64_t r0 = first + h * stride;
      const int64_t r1 = stride == per_head ? first + he * stride : r0 + per_head;
      softmax_tile<kTile>(c.p, r0, r1, per_head, c.group, pos0, t0, lo, hi, s.ss, s.ms, s.ls,
                          s.alphas);
    }
    for (int64_t h = hb; h < he; ++h) {
      const int64_t r0 = first + h * stride;
      pv_span<kTile>(s, dim8, r0, r0 + per_head, h, jl, jh, pf, pf_quota);
    }
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
    tile_step<kTile>(c, s, heads, step, per_head, per_head, 0, pos0, t0, lo, hi, krow, vrow, pf,
                     pf_quota);
  });
  write_item(c, it, rows, s, partials);
}

// A shared-prefix group (Item::seqs > 1: decode rows of consecutive sequences whose tables
// begin with the same blocks): each K/V tile of the shared prefix is read once for the query
// rows of every sequence (8 samples x 3 query heads = 24 rows a kv head at SmolLM2's n=8), then
// each sequence's rows go on over its own tail tiles. A row sees the same tiles in the same
// order as in an item of its own (the prefix ends on a tile edge, see make_plan) and its
// scores, softmax and P.V do not depend on the rows beside it, so its bits are the same.
template <int kTile>
void run_group(const Ctx& c, const Item& it, const Item* next) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim8 = c.dim8, group = c.group, seqs = it.seqs, heads = it.h1 - it.h0;
  const int64_t per_head = seqs * group, rows = per_head * heads;
  const int64_t step = kTile == kSmallTile ? heads : 1;
  const ItemScratch s = take_scratch<kTile>(rows, heads, step, dim8);
  const char* qb = static_cast<const char*>(p.q);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < seqs; ++i)
      for (int64_t gq = 0; gq < group; ++gq) {
        float* qr = s.qs + ((h * seqs + i) * group + gq) * dim8;
        const int64_t tok = p.cu_seqlens_q[it.seq + i], head = h * group + gq;
        to_float(qb + (tok * p.q_stride_token + head * p.q_stride_head) * c.esize, p.dtype,
                 p.head_dim, qr);
        for (int64_t d = 0; d < p.head_dim; ++d) qr[d] *= p.scale;
        std::fill(qr + p.head_dim, qr + dim8, 0.0f);
      }
  std::fill(s.os, s.os + rows * dim8, 0.0f);
  std::fill(s.ms, s.ms + rows, kNegInf);
  std::fill(s.ls, s.ls + rows, 0.0f);
  // Sequence i's tail as an item of its own (empty where its length is the prefix's).
  auto tail = [&](int64_t i) {
    const int32_t seq = static_cast<int32_t>(it.seq + i);
    return Item{seq, it.h0, it.h1, 0, 1, it.kv_end, p.seq_lens[seq], -1};
  };
  auto next_after = [&](int64_t i) {  // the item run after tail i-1: the next tail, or `next`
    for (; i < seqs; ++i)
      if (p.seq_lens[it.seq + i] > it.kv_end) return i;
    return seqs;
  };
  // Every row's position is past the prefix, so no shared tile is masked: pos0 = kv_end.
  int64_t nt = next_after(0);
  Item nx = nt < seqs ? tail(nt) : Item{};
  walk_tiles<kTile>(c, it, nt < seqs ? &nx : next, prefetch_calls<kTile>({per_head, heads, rows, 0}),
                    [&](int32_t t0, int32_t lo, int32_t hi, const char* const* krow,
                        const char* const* vrow, Prefetcher& pf, int64_t pf_quota) {
    tile_step<kTile>(c, s, heads, step, per_head, per_head, 0, it.kv_end, t0, lo, hi, krow, vrow,
                     pf, pf_quota);
  });
  const int64_t tail_calls = prefetch_calls<kTile>({group, heads, group * heads, 0});
  for (int64_t i = nt; i < seqs; i = nt) {
    const Item ti = tail(i);
    nt = next_after(i + 1);
    nx = nt < seqs ? tail(nt) : Item{};
    walk_tiles<kTile>(c, ti, nt < seqs ? &nx : next, tail_calls,
                      [&](int32_t t0, int32_t lo, int32_t hi, const char* const* krow,
                          const char* const* vrow, Prefetcher& pf, int64_t pf_quota) {
      tile_step<kTile>(c, s, heads, step, group, per_head, i * group, ti.kv_end - 1, t0, lo, hi,
                       krow, vrow, pf, pf_quota);
    });
  }
  char* ob = static_cast<char*>(p.out);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < seqs; ++i)
      for (int64_t gq = 0; gq < group; ++gq) {
        const int64_t r = (h * seqs + i) * group + gq, head = h * group + gq;
        float* o = s.os + r * dim8;
        const float inv = 1.0f / head_denominator(c, head, s.ms[r], s.ls[r]);
        for (int64_t d = 0; d < p.head_dim; ++d) o[d] *= inv;
        from_float(o, p.head_dim, p.dtype,
                   ob + (p.cu_seqlens_q[it.seq + i] * p.out_stride_token +
                         head * p.out_stride_head) * c.esize);
      }
}

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

// Shared-prefix groups hold at most this many query rows (sequences x num_heads): 72 at SmolLM2
// with n=8 (8 x 9); bounds the scratch of a group (rows x (2 head_dim + 19) floats) to ~150 KiB
// at head_dim 128.
constexpr int64_t kMaxGroupRows = 128;

// Positions [0, n) that sequences a and b read from the same physical blocks (so the same K/V),
// n cut to the shorter sequence and then down to a multiple of `tile`.
int32_t shared_prefix(const PagedAttentionParams& p, int32_t a, int32_t b, int32_t tile) {
  const int32_t len = std::min(p.seq_lens[a], p.seq_lens[b]);
  const int32_t* ta = p.block_tables + a * p.block_table_stride;
  const int32_t* tb = p.block_tables + b * p.block_table_stride;
  int64_t n = 0;
  for (int64_t k = 0; n < len && ta[k] == tb[k]; ++k)
    n = std::min<int64_t>(len, (k + 1) * p.block_size);
  return static_cast<int32_t>(n / tile * tile);
}

// Fills plan.lead and plan.links with the shared-prefix groups (run_group): runs of
// consecutive decode rows of one KV partition and no sliding window, each sharing with the row
// before at least the prefix (one tile or more) its first two rows share, at most max_seqs
// long. Groups are cut shorter until the batch has 4 items a busy thread (base_items: its items
// without groups). Returns whether any.
bool find_groups(const PagedAttentionParams& p, int32_t tile, int32_t part, int64_t base_items,
                 int64_t busy, Plan& plan) {
  const int32_t n = p.num_seqs;
  plan.links.assign(n, 0);
  plan.lead.assign(n, 1);
  auto single = [&](int32_t s) {
    return p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s] == 1 && p.seq_lens[s] <= part;
  };
  bool any = false;
  for (int32_t s = 1; s < n; ++s)
    if (single(s) && single(s - 1)) {
      plan.links[s] = shared_prefix(p, s - 1, s, tile);
      any = any || plan.links[s] > 0;
    }
  if (!any) return false;
  const int64_t need = busy > 1 ? 4 * busy : 1;
  // The group starting at row s: the rows after it that share at least what s shares with
  // s + 1. A row that shares less with the next than the next shares with the one after (the
  // last sample of one prompt before another's, when all prompts begin with the same cached
  // system prompt) stays alone, so the next prompt's samples group over their whole prefix.
  auto run_at = [&](int32_t s, int64_t max_seqs) {
    if (s + 1 >= n || plan.links[s + 1] == 0) return 1;
    if (s + 2 < n && plan.links[s + 2] > plan.links[s + 1]) return 1;
    int32_t len = 2;
    while (s + len < n && len < max_seqs && plan.links[s + len] >= plan.links[s + 1]) ++len;
    return len;
  };
  for (int64_t max_seqs = std::max<int64_t>(1, kMaxGroupRows / p.num_heads); max_seqs > 1;
       max_seqs /= 2) {
    int64_t merged = 0;
    for (int32_t s = 0; s < n; s += run_at(s, max_seqs)) merged += run_at(s, max_seqs) - 1;
    if (base_items - merged < need) continue;
    for (int32_t s = 0; s < n;) {
      const int32_t len = run_at(s, max_seqs);
      plan.lead[s] = len;
      for (int32_t i = 1; i < len; ++i) plan.lead[s + i] = 0;
      plan.links[s] = len > 1 ? plan.links[s + 1] : 0;  // a leader's entry: its group's prefix
      s += len;
    }
    return merged > 0;
  }
  return false;
}

// Splits the batch into items, ordered (sequence, q chunk, partition, kv heads). An item takes
// as many kv heads as fit kMaxRows rows: decode then reads each token's K/V rows of all heads
// together (1 KiB runs at 4 kv heads x 64 fp32) instead of 256-byte rows 1 KiB apart, which
// read DRAM ~1.5x slower on one core (measured without compute: 30 against 20 ns per key and
// head). Fewer heads per item when there would be under 4 items per thread.
void make_plan(const PagedAttentionParams& p, int64_t group, int threads, bool groupable,
               Plan& plan) {
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
  auto count_items = [&](int64_t cap) {
    int64_t count = 0;
    for_each_chunk(p, group, [&](int32_t, int32_t i0, int32_t i1, int32_t lo, int32_t hi) {
      const int64_t per = std::min(cap, fit(i0, i1));
      count += parts_of(lo, hi) * ((heads + per - 1) / per);
    });
    return count;
  };
  int64_t cap = heads;
  for (; cap > 1; cap = (cap + 1) / 2)
    if (count_items(cap) >= 4 * busy) break;
  // Groups take all kv heads of their rows: only where a decode row's item does.
  const int32_t tile = p.head_dim <= kSmallDim ? kSmallTile : kTile;
  const bool grouped = groupable && p.sliding_window <= 0 && std::min(cap, fit(0, 1)) >= heads &&
                       find_groups(p, tile, part, count_items(cap), busy, plan);
  int64_t offset = 0;
  for_each_chunk(p, group, [&](int32_t s, int32_t i0, int32_t i1, int32_t lo, int32_t hi) {
    if (grouped && plan.lead[s] != 1) {
      if (plan.lead[s] == 0) return;  // inside the group before it
      Item it{s, 0, static_cast<int32_t>(heads), 0, 1, 0, plan.links[s], -1};
      it.seqs = plan.lead[s];
      plan.items.push_back(it);
      return;
    }
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
  // Shared-prefix groups run on the fp32-math runner (run_group), not the bf16 one.
#if defined(__AVX512BF16__)
  make_plan(p, group, cpu::max_threads(), !bf16_body, plan);
#else
  make_plan(p, group, cpu::max_threads(), true, plan);
#endif
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
      if (plan.items[i].seqs > 1 && p.head_dim <= kSmallDim)
        run_group<kSmallTile>(c, plan.items[i], nx);
      else if (plan.items[i].seqs > 1)
        run_group<kTile>(c, plan.items[i], nx);
      else if (p.head_dim <= kSmallDim)
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

#if CBK_CPU_PORTABLE
// The run-time pick (cb_kernels/isa.h): bodies portable and avx2, and avx512_bf16 for bf16 K/V.
#if CBK_X86_BODIES
namespace cpu_avx2 {
Status paged_attention(const PagedAttentionParams& p);
}
namespace cpu_avx512_bf16 {
Status paged_attention(const PagedAttentionParams& p);
}
#endif

namespace cpu {
namespace {
constexpr Isa kBodies[] = {Isa::kPortable, Isa::kAvx2};
constexpr Isa kBf16Bodies[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16};
}  // namespace

Isa paged_attention_isa(Isa isa) { return pick(isa, kBodies); }
Isa paged_attention_bf16_isa(int64_t head_dim, Isa isa) {
  const Isa b = pick(isa, kBf16Bodies);
  return b == Isa::kAvx512Bf16 && head_dim % 32 != 0 ? pick(isa, kBodies) : b;
}

Status paged_attention(const PagedAttentionParams& p, Isa isa) {
#if CBK_X86_BODIES
  // bf16 K/V with head_dim % 32 == 0: the vdpbf16ps kernel where the CPU has AVX512-BF16 (the
  // fp32 math of the avx2 body otherwise: its AVX-512 compile was slower, see above).
  if (p.dtype == DType::kBFloat16 &&
      paged_attention_bf16_isa(p.head_dim, isa) == Isa::kAvx512Bf16)
    return cpu_avx512_bf16::paged_attention(p);
  if (pick(isa, kBodies) == Isa::kAvx2) return cpu_avx2::paged_attention(p);
#endif
  return cpu_portable::paged_attention(p);
}
}  // namespace cpu
#endif

}  // namespace cbk

