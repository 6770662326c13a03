// Paged attention on CPU (see cb_kernels/paged_attention.h for the contract).
//
// Work items are (sequence, q chunk, KV partition, kv head). A q chunk packs up to kMaxRows
// query rows (q tokens x the query heads of one KV head), so each K/V row is read from memory
// once for all of them. KV partitions are fixed kPartition-token ranges of absolute positions and
// tiles inside them fixed kTile-token ranges: how a row's scores are reduced depends only on its
// own sequence and position, never on the batch, the q chunking or the thread count. Partitions
// give decode with few sequences enough items to keep every thread busy; their partial results
// (unnormalised output, running max, running sum) are merged in a second pass.
//
// The math runs in fp32 on 8-float GCC vectors: the AVX2 variant compiles them to 256-bit
// FMAs, the generic one to SSE pairs. fp16/bf16 K/V tiles are converted to fp32 scratch once per
// tile, so the query rows sharing a tile pay the conversion once. (Checked in the AVX2 object's
// assembly: the QK and PV inner loops are runs of vfmadd231ps on ymm registers with memory
// operands, one per 8 floats of head_dim.)
//
// Measured on the 2-core EPYC (Zen 4, 2.6 GHz VM): with K/V in cache the time grows in step with
// head_dim (64/128/256), ~2 G 8-wide FMAs/s of thread CPU time, about what a register-only FMA
// loop reaches on this VM, so the loops run at the FMA rate; letting two rows share each V load
// changed nothing and was dropped. Decode with K/V in DRAM is
// bound by memory: see the prefetch note in run_item and bench/RESULTS.md.
#include "cb_kernels/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "isa.h"
#include "threads.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

// The generic variant passes 32-byte vectors between inline functions without AVX; they never
// cross an ABI boundary (all in this file's anonymous namespace), so GCC's ABI note is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

constexpr int kTile = 32;         // KV tokens per online-softmax step
constexpr int kPartition = 256;   // KV tokens per work item (a multiple of kTile)
constexpr int kMaxRows = 64;      // query rows per work item (more when one group is larger)
constexpr int64_t kGrainWork = 16384;  // (query row, key) pairs worth a thread: ~40 us at d=64
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(v8f v) {
  const v8f a = v + CBK_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  const v8f b = a + CBK_SHUFFLE(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  return b[0] + b[1];
}

// exp(x) for x <= 0 (every caller subtracts a running max); -inf and x < -87.3 give 0.
// Cephes-style: 2^n * poly(r), relative error ~2e-7.
inline v8f exp8(v8f x) {
  const v8i underflow = x < splat(-87.3f);
  x = vmax(x, splat(-87.3f));
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8f n = (x * splat(1.44269504088896341f) + magic) - magic;
  const v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return underflow ? splat(0.0f) : p * scale;
}

// c * tanh(x / c) with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|) (never overflows).
inline v8f softcap8(v8f x, float cap) {
  const v8f y = x * splat(1.0f / cap);
  const v8f a = y < splat(0.0f) ? -y : y;
  const v8f e = exp8(splat(-2.0f) * a);
  const v8f t = (splat(1.0f) - e) / (splat(1.0f) + e);
  return splat(cap) * (y < splat(0.0f) ? -t : t);
}

// Scores of R query rows (q_stride floats apart) against T = 8 / R key rows, written to
// s[r * s_stride + t]; a transposing add tree turns the 8 (row, key) accumulators into one vector
// (lane r * T + t). Each K chunk loaded feeds R FMAs. Every (row, key) pair keeps
// its own lane partial sums over head_dim and goes through the same transposing add tree, so a
// score does not depend on R or on its place in the block.
template <int R>
inline void dot_block(const float* q, int64_t q_stride, const float* const* k, int64_t dim8,
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

// Scores of rows [0, rows) against the keys of one tile, kTile per row at s (s_stride apart):
// blocks of two rows (4 keys per tree), a last odd row alone (8 keys per tree).
template <int kTileKeys>
inline void tile_scores(const float* q, int64_t rows, const float* const* k, int g0, int g1,
                        int64_t dim8, float* s, Prefetcher& pf, int pf_step) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    for (int g = g0; g < g1; g += 4) {
      pf.step(pf_step);
      dot_block<2>(q + r * dim8, dim8, k + g, dim8, s + r * kTileKeys + g, kTileKeys);
    }
  }
  if (r < rows)
    for (int g = g0 / 8 * 8; g < g1; g += 8, pf.step(pf_step))
      dot_block<1>(q + r * dim8, dim8, k + g, dim8, s + r * kTileKeys + g, kTileKeys);
}

// o_r[0 .. 8*NV) = o_r * alpha_r + sum_j p_r[j] * v[j][0 .. 8*NV) for R rows at once, so each V
// chunk loaded feeds R FMAs; accumulators stay in registers. A row's sums run in j order
// whatever R is.
template <int R, int NV>
inline void pv_block(float* o, int64_t o_stride, const float* alpha, const float* p,
                     int64_t p_stride, const float* const* v, int j0, int j1, int64_t c0) {
  v8f acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = load8(o + r * o_stride + c0 + 8 * i) * splat(alpha[r]);
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

template <int R, int NV>
inline void pv_rows(float* o, int64_t dim8, const float* alpha, const float* p, int64_t p_stride,
                    const float* const* v, int j0, int j1) {
  int64_t c = 0;
  for (; c + 8 * NV <= dim8; c += 8 * NV) pv_block<R, NV>(o, dim8, alpha, p, p_stride, v, j0, j1, c);
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
inline void softmax_tile(const PagedAttentionParams& p, int64_t r0, int64_t r1, int64_t group,
                         int32_t pos0, int32_t t0, int32_t lo, int32_t hi, float* ss, float* ms,
                         float* ls, float* alphas) {
  for (int64_t r8 = r0; r8 < r1; r8 += 8) {
    float m_old[8], m_new[8], sums[8];
    const int64_t n = std::min<int64_t>(8, r1 - r8);
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t r = r8 + i;
      m_old[i] = m_new[i] = i < n ? ms[r] : 0.0f;
      sums[i] = 0.0f;
      if (i >= n) continue;
      const int32_t pos = pos0 + static_cast<int32_t>((r - r0) / group);
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

void run_item(const Ctx& c, const Item& it, const Item* next, float* partials) {
  const PagedAttentionParams& p = c.p;
  const int64_t dim = p.head_dim, dim8 = c.dim8, group = c.group;
  const int64_t per_head = (it.i1 - it.i0) * group, heads = it.h1 - it.h0;
  const int64_t rows = per_head * heads;
  const int32_t seq_len = p.seq_lens[it.seq];
  const int32_t q_len = p.cu_seqlens_q[it.seq + 1] - p.cu_seqlens_q[it.seq];
  const int32_t pos0 = seq_len - q_len + it.i0;  // position of the item's first q token

  thread_local Scratch scratch;
  const int64_t need = rows * (2 * dim8 + kTile + 3) + 2 * kTile * dim8 + dim8;
  if (static_cast<int64_t>(scratch.buf.size()) < need) scratch.buf.resize(need);
  int64_t used = 0;
  float* qs = scratch.take(rows * dim8, used);
  float* os = scratch.take(rows * dim8, used);
  float* ss = scratch.take(rows * kTile, used);
  float* ms = scratch.take(rows, used);      // running max
  float* ls = scratch.take(rows, used);      // running sum
  float* alphas = scratch.take(rows, used);  // this tile's rescale of the earlier ones
  float* kt = scratch.take(kTile * dim8, used);
  float* vt = scratch.take(kTile * dim8, used);
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
  const float* kp[kTile];
  const float* vp[kTile];
  // Addresses of head h0's K/V rows of this tile and the next (slot pos - t0); the item's other
  // heads are k_head/v_head bytes on. The next tile's rows of all the item's heads are prefetched
  // while this one is computed: blocks come in random order, which the hardware prefetcher does
  // not follow.
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
    for (int j = 0; j < kTile; ++j)
      if (j < jl || j >= jh) kp[j] = vp[j] = zero;
    for (int64_t h = 0; h < heads; ++h) {
      for (int j = jl; j < jh; ++j) {
        const char* kr = krow[cur][j] + h * k_head;
        const char* vr = vrow[cur][j] + h * v_head;
        if (c.direct_kv) {
          kp[j] = reinterpret_cast<const float*>(kr);
          vp[j] = reinterpret_cast<const float*>(vr);
        } else {
          float* kd = kt + j * dim8;
          float* vd = vt + j * dim8;
          to_float(kr, p.dtype, dim, kd);
          to_float(vr, p.dtype, dim, vd);
          std::fill(kd + dim, kd + dim8, 0.0f);
          std::fill(vd + dim, vd + dim8, 0.0f);
          kp[j] = kd;
          vp[j] = vd;
        }
      }
      const int64_t r0 = h * per_head, r1 = r0 + per_head;
      tile_scores<kTile>(qs + r0 * dim8, per_head, kp, jl / 4 * 4, jh, dim8, ss + r0 * kTile, pf,
                         pf_quota);
      softmax_tile(p, r0, r1, group, pos0, t0, lo, hi, ss, ms, ls, alphas);
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2, pf.step(pf_quota))
        pv_rows<2, 4>(os + r * dim8, dim8, alphas + r, ss + r * kTile, kTile, vp, jl, jh);
      if (r < r1) pv_rows<1, 8>(os + r * dim8, dim8, alphas + r, ss + r * kTile, kTile, vp, jl, jh);
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
  auto parts_of = [](int32_t lo, int32_t hi) { return (hi - 1) / kPartition - lo / kPartition + 1; };
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
    const int32_t k0 = lo / kPartition, k1 = (hi - 1) / kPartition, parts = k1 - k0 + 1;
    const int32_t per = static_cast<int32_t>(std::min(cap, fit(i0, i1)));
    const int32_t groups = static_cast<int32_t>((heads + per - 1) / per);
    for (int32_t g = 0; parts > 1 && g < groups; ++g)
      plan.merges.push_back({static_cast<int64_t>(plan.items.size()) + g, groups, parts});
    for (int32_t k = k0; k <= k1; ++k) {
      const int32_t end =
          static_cast<int32_t>(std::min<int64_t>(hi, (k + 1) * int64_t{kPartition}));
      for (int32_t h0 = 0; h0 < heads; h0 += per) {
        const int32_t h1 = static_cast<int32_t>(std::min<int64_t>(heads, h0 + per));
        Item it{s, h0, h1, i0, i1, std::max(lo, k * kPartition), end, -1};
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
      run_item(c, plan.items[i], n < num_items ? &plan.items[n] : nullptr, partials);
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

CBK_CPU_DISPATCH(Status, paged_attention, const PagedAttentionParams&)
