// Paged attention on CPU (see cb_kernels/paged_attention.h for the contract).
//
// Work items are (sequence, q chunk, KV partition, kv heads [h0, h1)). A q chunk packs up to
// kMaxRows query rows per kv head (q tokens x the query heads of its group), so each K/V row is
// read from memory once for all of them; an item takes as many kv heads as fit kMaxRows rows
// (decode: all of them, so it reads each token's K/V rows of every head together). KV partitions
// are fixed kPartition-token ranges of absolute positions and tiles inside them fixed kTile-token
// ranges (kSmallPartition and kSmallTile at head_dim <= kSmallDim: a choice by head_dim alone);
// rows are computed in blocks of 2, 3 or 1 whose arithmetic per row is the same either way. So
// how a row's scores are reduced depends only on its own sequence and position, never on the
// batch, the q chunking, the head grouping or the thread count. Partitions give decode with few
// sequences enough items to keep every thread busy; their partial results (unnormalised output,
// running max, running sum) are merged in a second pass.
//
// The math runs in fp32 on 8-float GCC vectors (attention_vec.h): the AVX2 variant compiles them
// to 256-bit FMAs, the generic one to SSE pairs. Per tile and kv head: scores of 2 rows x 4 keys
// from 8 accumulators and one transposing add tree (one tree per 8 scores); masking only in
// tiles cut by the causal/window edge or the item's range; exp8 over the tile; the running max
// and the rescale once per row and tile, 8 rows per exp8; P.V in blocks of 2 rows x 4 vectors,
// each V chunk loaded once into a register for both rows. fp16/bf16 K/V rows are converted to
// fp32 scratch per tile and head, so the query rows sharing them pay the conversion once.
//
// Measured 2026-11-29 on the 2-core EPYC (Zen 4 VM, ~3.6 GHz), fp32, 16 q / 4 kv heads, d 64,
// against main's kernel (b0ab835) in the same process, one thread: decode 1 x 2048 (K/V in
// cache) 0.74x the time, 16 x 2048 (67 MB, DRAM) 0.61-0.76x (typically 0.67-0.72x), prefill 1 x
// 1024 0.65x, d 128/256 0.70/0.76x; two threads, 16 x 2048: 0.69-0.78x. In bench_attention.py on
// an idle machine, two threads: 2.57-2.95 ms against main's 3.75-3.83, 58-77% of the copy
// bandwidth measured in the same run (bench/RESULTS.md). A register-only loop runs 10.5 G 8-wide
// FMAs/s per core, so the FMAs are not the limit (~30% of the decode time in cache); from DRAM
// the time is about the in-cache time plus ~8-15 ns per (key, kv head) that prefetching does not
// hide: a reads-only loop with the same block order and prefetches costs 20 ns per (key, kv
// head) alone, and 31 ns with 24 ns of FMAs per key added. What paid, in order: each K/V chunk
// loaded once per row block (0.86x), prefetches spread over the tile's dot blocks instead of one
// burst (0.83x), all kv heads in one item reading whole token rows (256-byte rows 1 KiB apart
// read DRAM 1.5x slower), 16-key tiles (one thread 0.83-0.91x the time at 32 keys from DRAM,
// 0.92-1.0x on two; 32 keys is 5% faster in cache), vhaddps for the add tree (1-3%), one line
// per 4 KiB page touched a tile before the rows are prefetched (torch puts K/V 64 bytes into a
// page, so a 16 KiB block spans 5 pages: 0.90-0.94x in the bench on two threads).
// Tried and dropped: blocks of 4 rows (each K/V line read once: 0.66x in cache at 32 keys but
// slower from DRAM, and 4-17% slower at 16 keys), prefetching one head's rows 2 to 4 (tile, head)
// steps ahead (0.78-0.89x against 0.75-0.81x), prefetching 1.5-2.5x faster or 0.6x as fast as
// the even spread (6-30% slower), a line queue fed from the inner loops (13% slower in cache),
// K lines before V lines, prefetcht0 or prefetchnta (no better than no prefetch), 64-key tiles,
// fp32 rows copied to scratch like fp16/bf16 (1.2-1.45x slower).
//
// Small heads (2026-11-30, the engine bench's tiny Llama: fp32, 8 q / 2 kv heads, d 32, block
// 16), against main's kernel (dadab40) in the same process: decode of 37 sequences of 16..770
// tokens 0.76-0.79x the time on one thread, 0.78-0.84x on two with the K/V of 8 such layers
// rotating (DRAM), 0.77-0.82x on one thread and 0.86-1.0x on two with the caches flushed by a
// 96 MB pass before each call (the engine's case: its other work evicts the K/V between layer
// calls, which makes a call ~1.6x its in-cache time); prefill chunks of 512 tokens (2-3
// prompts, causal) 0.84-0.89x on one thread, 0.87-0.92x on two; d 64 and d 128 decode and d 64
// prefill bit-identical and 0.97-1.03x. In bench_engine.py's default run on two threads, every
// attention call timed: decode calls 0.50-0.54 ms against 0.57-0.61 (0.86-0.88x), the steps
// with prefill chunks 0.94-1.02x (noise of the shared machine).
// Per (key, kv head) a d 32 decode does 16 FMAs of QK and 16 of P.V (8 cycles each at two
// FMAs a cycle) and 4 exps: sampled with perf, P.V's FMAs are ~23% of the time, QK ~32% (half
// of it the add tree and the score stores), exp ~10%, the prefetcher ~8%; the rest is the per
// tile and per row work that 16-key tiles paid once per 16 keys. What paid: 64-key tiles
// (decode 0.81x, prefill 0.89x; 32 keys 0.87x/0.93x; 128 keys 1.1x slower prefill, its scores
// leave L1), 512-key partitions (fewer items and merges: 0.95x; 1024 keys 0.97x more but half
// the items for short batches), all heads' QK before the softmax before all heads' P.V at
// 64-key tiles (0.96x decode; at 16-key tiles d 64 from DRAM was 1.2x slower, so those keep one
// head after the other), P.V in blocks of 3 rows for prefill (0.97x; decode's 4 rows a head
// stay in blocks of 2: 3 + 1 was 1.04x slower). Tried and dropped: the softmax of 8 rows in two
// passes (tile maxima of all 8, then their exps: 1.06-1.09x slower), a cheaper exp (4 fewer
// polynomial terms: only 0.96x, not worth its error), 32 or 128 query rows per item (no
// change), zeroing only the pointer slots the dot blocks read past the range, one prefetch span
// per key over contiguous heads (no change or slower), the kernel compiled for AVX-512
// (x86-64-v4: 1.06x slower; EVEX on the AVX2 code alone: 0.97x, not worth a third variant),
// touching pages 2-20 tiles ahead instead of 1 (cold decode: no change beyond noise).
// Where 2x is out of reach: decode from DRAM on two threads now reads K/V at 18-30 GB/s
// (flushed / rotating), near the machine's copy bandwidth (25 GB/s for a one-thread 128 MiB
// copy measured alongside), and the engine's calls at ~15 GB/s are bound by that memory; in
// cache its FMAs alone take 16 of the ~44 cycles per (key, kv head), the rest spread thin over
// the tree, exp, prefetch and pointer setup (none above ~15%); prefill runs at ~40% of the FMA
// peak (QK ~1/3 of the time, P.V ~1/4, the softmax ~1/5).
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
};

inline int64_t round8(int64_t x) { return (x + 7) / 8 * 8; }

// Offset of row r's query/output vector, in elements, for q or out strides.
inline int64_t row_offset(const Ctx& c, const Item& it, int64_t r, int64_t stride_token,
                          int64_t stride_head) {
  const int64_t per_head = (it.i1 - it.i0) * c.group, rem = r % per_head;
  const int64_t tok = c.p.cu_seqlens_q[it.seq] + it.i0 + rem / c.group;
  const int64_t head = (it.h0 + r / per_head) * c.group + rem % c.group;
  return tok * stride_token + head * stride_head;
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

template <int kTile>
void run_item(const Ctx& c, const Item& it, const Item* next, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim = p.head_dim, dim8 = c.dim8, group = c.group;
  const int64_t per_head = (it.i1 - it.i0) * group, heads = it.h1 - it.h0;
  const int64_t rows = per_head * heads;
  const int32_t seq_len = p.seq_lens[it.seq];
  const int32_t q_len = p.cu_seqlens_q[it.seq + 1] - p.cu_seqlens_q[it.seq];
  const int32_t pos0 = seq_len - q_len + it.i0;  // position of the item's first q token

  // Heads whose tiles are live at once (see the tile loop).
  const int64_t step = kTile == kSmallTile ? heads : 1;
  thread_local Scratch scratch;
  const int64_t need = rows * (2 * dim8 + kTile + 3) + 2 * step * kTile * dim8 + dim8;
  if (static_cast<int64_t>(scratch.buf.size()) < need) scratch.buf.resize(need);
  int64_t used = 0;
  float* qs = scratch.take(rows * dim8, used);
  float* os = scratch.take(rows * dim8, used);
  float* ss = scratch.take(rows * kTile, used);
  float* ms = scratch.take(rows, used);      // running max
  float* ls = scratch.take(rows, used);      // running sum
  float* alphas = scratch.take(rows, used);  // this tile's rescale of the earlier ones
  float* kt = scratch.take(step * kTile * dim8, used);  // fp16/bf16 rows as fp32, per live head
  float* vt = scratch.take(step * kTile * dim8, used);
  thread_local std::vector<const float*> ptrs;  // each head's K then V row pointers of a tile
  if (static_cast<int64_t>(ptrs.size()) < 2 * heads * kTile) ptrs.resize(2 * heads * kTile);
  const float** kps = ptrs.data();
  const float** vps = kps + heads * kTile;
  float* zero = scratch.take(dim8, used);
  std::fill(zero, zero + dim8, 0.0f);

  const char* qb = static_cast<const char*>(p.q);
  for (int64_t r = 0; r < rows; ++r) {
    float* qr = qs + r * dim8;
    to_float(qb + row_offset(c, it, r, p.q_stride_token, p.q_stride_head) * c.esize, p.dtype,
             dim, qr);
    for (int64_t d = 0; d < dim; ++d) qr[d] *= p.scale;
    std::fill(qr + dim, qr + dim8, 0.0f);
  }
  std::fill(os, os + rows * dim8, 0.0f);
  std::fill(ms, ms + rows, kNegInf);
  std::fill(ls, ls + rows, 0.0f);

  const char* kb = static_cast<const char*>(p.k_cache);
  const char* vb = static_cast<const char*>(p.v_cache);
  // Addresses of head h0's K/V rows of this tile and the next (slot pos - t0); the item's other
  // heads are k_head/v_head bytes on. While a tile is computed, the next one's rows of all the
  // item's heads are prefetched in memory order, a few lines per dot block; the last tile
  // prefetches the first tile of the item this thread runs next. Blocks come in random order,
  // which the hardware prefetcher does not follow: without prefetching, decode 16 x 2048 took
  // 1.9x as long on one thread.
  const char* krow[2][kTile];
  const char* vrow[2][kTile];
  const int64_t k_head = p.k_stride_head * c.esize, v_head = p.v_stride_head * c.esize;
  const int64_t k_tok = p.k_stride_token * c.esize, v_tok = p.v_stride_token * c.esize;
  Prefetcher pf{nullptr, nullptr, 0, 0, 0, 0, 0};
  auto locate = [&](const Item& at, int32_t t0, const char** kr, const char** vr) {
    const int32_t lo = std::max(t0, at.kv_begin), hi = std::min(t0 + kTile, at.kv_end);
    const int32_t* table = p.block_tables + at.seq * p.block_table_stride;
    for (int32_t pos = lo; pos < hi;) {
      const int64_t block = table[pos / p.block_size];
      const int32_t off = static_cast<int32_t>(pos % p.block_size);
      const int32_t n = std::min<int32_t>(hi - pos, static_cast<int32_t>(p.block_size) - off);
      const char* k0 = kb + (block * p.k_stride_block + off * p.k_stride_token) * c.esize +
                       at.h0 * k_head;
      const char* v0 = vb + (block * p.v_stride_block + off * p.v_stride_token) * c.esize +
                       at.h0 * v_head;
      for (int32_t i = 0; i < n; ++i) {
        kr[pos - t0 + i] = k0 + i * k_tok;
        vr[pos - t0 + i] = v0 + i * v_tok;
      }
      pos += n;
    }
    pf = Prefetcher{kr + (lo - t0), vr + (lo - t0), k_head, v_head, hi - lo, at.h1 - at.h0,
                    dim * c.esize};
    // One line per 4 KiB page of the tile after, so that its address translations are warm
    // when its rows are prefetched a tile later.
    const int32_t lo2 = std::max(t0 + kTile, at.kv_begin);
    const int32_t hi2 = std::min(t0 + 2 * kTile, at.kv_end);
    for (int32_t pos = lo2; pos < hi2;) {
      const int64_t block = table[pos / p.block_size];
      const int32_t off = static_cast<int32_t>(pos % p.block_size);
      const int32_t n = std::min<int32_t>(hi2 - pos, static_cast<int32_t>(p.block_size) - off);
      const char* k0 = kb + (block * p.k_stride_block + off * p.k_stride_token) * c.esize +
                       at.h0 * k_head;
      const char* v0 = vb + (block * p.v_stride_block + off * p.v_stride_token) * c.esize +
                       at.h0 * v_head;
      const int64_t kspan = (n - 1) * k_tok + (at.h1 - at.h0 - 1) * k_head + dim * c.esize;
      const int64_t vspan = (n - 1) * v_tok + (at.h1 - at.h0 - 1) * v_head + dim * c.esize;
      for (int64_t b = 0; b < kspan; b += 4096) __builtin_prefetch(k0 + b, 0, 1);
      for (int64_t b = 0; b < vspan; b += 4096) __builtin_prefetch(v0 + b, 0, 1);
      __builtin_prefetch(k0 + kspan - 1, 0, 1);
      __builtin_prefetch(v0 + vspan - 1, 0, 1);
      pos += n;
    }
  };
  // Prefetch steps per tile: one per QK dot block and per PV row pair, for every head.
  const int64_t pairs = (per_head + 1) / 2;
  const int64_t pf_calls = heads * pairs * (kTile / 4 + 1);
  int cur = 0;
  const int32_t first_tile = it.kv_begin / kTile * kTile;
  locate(it, first_tile, krow[0], vrow[0]);
  pf.step(pf.lines());
  for (int32_t t0 = first_tile; t0 < it.kv_end; t0 += kTile, cur ^= 1) {
    const int32_t lo = std::max(t0, it.kv_begin), hi = std::min(t0 + kTile, it.kv_end);
    if (t0 + kTile < it.kv_end) {
      locate(it, t0 + kTile, krow[cur ^ 1], vrow[cur ^ 1]);
    } else if (next) {
      // The first tile of the item this thread runs next.
      locate(*next, next->kv_begin / kTile * kTile, krow[cur ^ 1], vrow[cur ^ 1]);
    } else {
      pf.keys = 0;
    }
    const int64_t pf_quota = (pf.lines() + pf_calls - 1) / pf_calls;
    const int jl = lo - t0, jh = hi - t0;  // the tile's keys inside this item's range
    // With 64-key tiles all heads' scores, then all rows' softmax, then all heads' P.V: the
    // heads' chains of work are independent and overlap where one head's QK -> softmax -> P.V
    // would wait (decode d 32: 0.96x the time). At 16-key tiles (d > 32) one head after the
    // other: the order over all heads read d 64 from DRAM 1.2x slower.
    for (int64_t hb = 0; hb < heads; hb += step) {
      const int64_t he = hb + step;
      for (int64_t h = hb; h < he; ++h) {
        const float** kp = kps + h * kTile;
        const float** vp = vps + h * kTile;
        for (int j = 0; j < kTile; ++j)
          if (j < jl || j >= jh) kp[j] = vp[j] = zero;
        for (int j = jl; j < jh; ++j) {
          const char* kr = krow[cur][j] + h * k_head;
          const char* vr = vrow[cur][j] + h * v_head;
          if (c.direct_kv) {
            kp[j] = reinterpret_cast<const float*>(kr);
            vp[j] = reinterpret_cast<const float*>(vr);
          } else {
            float* kd = kt + ((h - hb) * kTile + j) * dim8;
            float* vd = vt + ((h - hb) * kTile + j) * dim8;
            to_float(kr, p.dtype, dim, kd);
            to_float(vr, p.dtype, dim, vd);
            std::fill(kd + dim, kd + dim8, 0.0f);
            std::fill(vd + dim, vd + dim8, 0.0f);
            kp[j] = kd;
            vp[j] = vd;
          }
        }
      }
      for (int64_t h = hb; h < he; ++h) {
        const int64_t r0 = h * per_head;
        tile_scores<kTile>(qs + r0 * dim8, per_head, kps + h * kTile, jl / 4 * 4, jh, dim8,
                           ss + r0 * kTile, pf, pf_quota);
      }
      softmax_tile<kTile>(p, hb * per_head, he * per_head, per_head, group, pos0, t0, lo, hi, ss,
                          ms, ls, alphas);
      for (int64_t h = hb; h < he; ++h) {
        const float* const* vp = vps + h * kTile;
        const int64_t r1 = (h + 1) * per_head;
        int64_t r = h * per_head;
        // Blocks of 3 rows load each V chunk for 12 FMAs (prefill at d 32: 0.97x the time); a
        // row's sums run in the same order in any block, so this choice may depend on the item.
        if (dim8 == 32 && per_head > 4)
          for (; r + 3 <= r1; r += 3, pf.step(pf_quota))
            pv_rows<3, 4>(os + r * dim8, dim8, alphas + r, ss + r * kTile, kTile, vp, jl, jh);
        for (; r + 2 <= r1; r += 2, pf.step(pf_quota))
          pv_rows<2, 4>(os + r * dim8, dim8, alphas + r, ss + r * kTile, kTile, vp, jl, jh);
        if (r < r1)
          pv_rows<1, 8>(os + r * dim8, dim8, alphas + r, ss + r * kTile, kTile, vp, jl, jh);
      }
    }
    pf.step(pf.lines());
  }

  if (it.partial < 0) {
    char* ob = static_cast<char*>(p.out);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = os + r * dim8;
      const float inv = 1.0f / ls[r];
      for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
      from_float(o, dim, p.dtype,
                 ob + row_offset(c, it, r, p.out_stride_token, p.out_stride_head) * c.esize);
    }
    return;
  }
  float* dst = partials + it.partial;  // [rows][dim] outputs, then [rows] maxima, [rows] sums
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dim, os + r * dim8, dim * sizeof(float));
  std::memcpy(dst + rows * dim, ms, rows * sizeof(float));
  std::memcpy(dst + rows * dim + rows, ls, rows * sizeof(float));
}

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
    const float inv = 1.0f / l;
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
  const Ctx c{p, group, round8(p.head_dim), dtype_size(p.dtype),
              p.dtype == DType::kFloat32 && p.head_dim % 8 == 0};

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

