// Greedy LM head on CPU (see cb_kernels/greedy_head.h for the idea).
//
// Why: on the tiny Llama of bench_engine.py (hidden 256, vocab 32000) the fp32 head of a 32-row
// decode step is 262 M FMAs, 3.1 ms on the 2-core bench machine with oneDNN's packed GEMM (72%
// of its FMA peak) and ~40% of the whole step. VNNI's int8 dot products run at 4x that peak.
//
// The bound. Weights are quantised per vocab row (scale s_j = max|w_j| / 127) and each hidden
// row per call (scale s_h = max|h| / 127), both rounding to nearest. With h~ and w~ the quantised
// vectors, the exact logit e_j = <h, w_j> and the score a_j = <h~, w~_j> (an exact integer dot
// times s_h s_j) differ by |<h - h~, w_j>| + |<h~, w_j - w~_j>|, and each of the two is at most
// both its elementwise bound and its Cauchy-Schwarz bound:
//   |<h - h~, w_j>|   <= min(s_h/2 ||w_j||_1,  ||h - h~||_2 ||w_j||_2)
//   |<h~, w_j - w~_j>| <= min(s_j/2 ||h~||_1,  ||h~||_2 ||w_j - w~_j||_2)
// (the norms of w_j are packed with it, those of h computed per call). Dims the caller marks
// exact (a few outlier dims: SmolLM2-135M has rows with one dim at 16x the row's RMS) are left
// out of h~ and of its scale; their part of the logit is added in fp32 (<= 8 terms). The float
// arithmetic of the score, that part, the bound and the rescored logit adds at most
// 2^-20 max|h| ||w_j||_1 (|a_j| <= 2 max|h| ||w_j||_1), covered here by 2^-18 of it. With b_j
// that sum (scaled up by 1.001 against its own rounding) and L = max_j (a_j - b_j), a row with
// a_j + b_j < L cannot hold the maximum, nor tie with it: every other is a candidate. On
// SmolLM2-135M's real hidden states the min() of the two forms leaves 3.6x fewer candidates
// than the first alone, and the exact outlier dims 3x fewer again (median 738 of 786k logits
// for 16 rows).
//
// Two passes. Pass 1 streams the packed weight once for all rows: scores, bounds, each row's
// running L, and the vocab rows whose a_j + b_j reaches the running L appended to the row's list
// (a superset of the final candidates: L only rises). Pass 2 keeps the entries that reach the
// final L and computes exact logits largest a_j + b_j first, stopping at the first bound below
// the best exact logit (rescore_row). Finding the candidates by a second int8 pass over every
// tile that could hold one re-read ~35 MB of weight bytes per hidden row at the Llama-3.2-1B
// shape (vocab 128256, hidden 2048): 30 ms of a 16-row step.
//
// The file is built portable and avx512_vnni (cb_kernels/isa.h): the flags of each compile pick
// the two ISA-specific steps (score_tiles, exact_logit_of). The portable body
// does the same integer arithmetic, so both give the same tokens.
//
// Shared state and constants: greedy_head_work.h; the VNNI body: greedy_head_vnni.h.
#include "cb_kernels/greedy_head.h"

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "greedy_head_vnni.h"
#include "greedy_head_work.h"
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
using cpu::max_threads;
namespace {

#if !CBK_GREEDY_HEAD_VNNI
// h: [n] the hidden row in double; wj: [n] vocab row j of the fp32 weight.
float exact_logit(const double* h, const float* wj, int64_t n) {
  double s[16] = {};
  for (int64_t k = 0; k < n; ++k) s[k % 16] += h[k] * static_cast<double>(wj[k]);
  return fold_sums(s);
}

// The epilogue of one row over one tile: 64 integer dots (with the +128 offset still in) ->
// scores and bounds; the row's largest score - bound moves on, then the vocab rows whose score +
// bound reach it join the row's candidates. dots: [kTile].
inline void tile_epilogue(const Work& w, int64_t row, int64_t j0, const int32_t* dots, Slice* s) {
  const GreedyHeadParams& p = w.p;
  const float hs = w.hscale[row], u = w.u[row], v = w.v[row], pn = w.pn[row], qn = w.qn[row],
              r = w.r[row];
  const int32_t off = w.offset[row];
  float hi[kTile];
  float tile_lo = -INFINITY;
  for (int64_t i = 0; i < kTile; ++i) {
    const int64_t j = j0 + i;
    if (j >= p.vocab) {
      hi[i] = -INFINITY;
      continue;
    }
    const float sj = w.scale[j];
    float a = static_cast<float>(dots[i] - off) * (hs * sj);
    for (int64_t e = 0; e < p.num_exact; ++e)
      a += w.hx[row * p.num_exact + e] * p.exact_cols[e * w.padded_vocab + j];
    const float b = std::min(u * w.l1[j], pn * w.l2[j]) + std::min(v * sj, qn * w.err[j]) +
                    r * w.l1[j] + kTinySlack;
    hi[i] = a + b;
    tile_lo = std::max(tile_lo, a - b);
  }
  float& best = s->best_lo[row];
  best = std::max(best, tile_lo);
  Candidates& c = s->cands[row];
  if (c.over) return;
  c.reserve(kTile);
  const float floor = pass1_floor(w, best);
  for (int64_t i = 0; i < kTile; ++i)
    if (hi[i] >= floor) c.j[c.n] = static_cast<int32_t>(j0 + i), c.hi[c.n] = hi[i], ++c.n;
  after_append(w, s, row);
}

// One hidden row over tile t, plain loops.
void tile_row_portable(const Work& w, int64_t t, int64_t row, Slice* s) {
  const uint8_t* tile = w.p.packed + t * w.groups * kTile * 4;
  const int8_t* h = w.hq.data() + row * w.padded_hidden;
  int32_t dots[kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    int32_t acc = 0;
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint8_t* b = tile + (g * kTile + i) * 4;
      for (int q = 0; q < 4; ++q) acc += static_cast<int32_t>(b[q]) * h[4 * g + q];
    }
    dots[i] = acc;
  }
  tile_epilogue(w, row, t * kTile, dots, s);
}

// The two ISA-specific steps, portable body.
void score_tiles(const Work& w, int64_t t0, int64_t t1, Slice& s) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t row = 0; row < w.p.num_rows; ++row) tile_row_portable(w, t, row, &s);
}
float exact_logit_of(const double* h, const float* wj, int64_t n) { return exact_logit(h, wj, n); }

#endif  // !CBK_GREEDY_HEAD_VNNI

}  // namespace

namespace {

// Sizes the per-call state and marks the exact dims (exact[k] == 1).
Status init_work(const GreedyHeadParams& p, Work& w, std::vector<char>& exact) {
  const int64_t rows = p.num_rows;
  w.padded_hidden = greedy_head_padded_hidden(p.hidden);
  w.groups = w.padded_hidden / 4;
  w.padded_vocab = greedy_head_padded_vocab(p.vocab);
  w.tiles = w.padded_vocab / kTile;
  w.hq.assign(rows * w.padded_hidden, 0);
  w.offset.resize(rows);
  w.hscale.resize(rows);
  for (auto* v : {&w.u, &w.v, &w.pn, &w.qn, &w.r}) v->resize(rows);
  w.scale = p.row_stats;
  w.l1 = w.scale + w.padded_vocab;
  w.l2 = w.l1 + w.padded_vocab;
  w.err = w.l2 + w.padded_vocab;
  if (p.num_exact < 0 || p.num_exact > 64 || (p.num_exact > 0 && (!p.exact_dims || !p.exact_cols)))
    return Status::Error("greedy_head: need 0 <= num_exact <= 64 and its dims and columns");
  exact.assign(p.hidden, 0);
  for (int64_t e = 0; e < p.num_exact; ++e) {
    if (p.exact_dims[e] < 0 || p.exact_dims[e] >= p.hidden || exact[p.exact_dims[e]])
      return Status::Error("greedy_head: exact_dims must be distinct dims < hidden");
    exact[p.exact_dims[e]] = 1;
  }
  w.hx.resize(rows * p.num_exact);
  return Status::Ok();
}

// Hidden row r -> its int8 vector, the +128 offset of the packed bytes, its exact dims and the
// factors of its bound (see the top of the file). False: a value is not finite or > 1e15.
bool quantize_row(const GreedyHeadParams& p, Work& w, const std::vector<char>& exact, int64_t r) {
  const float* h = p.hidden_states + r * p.hidden_stride;
  float mx = 0.0f, mx_int8 = 0.0f;   // over all dims, over the int8 ones
  bool finite = true;
  for (int64_t k = 0; k < p.hidden; ++k) {
    finite = finite && std::isfinite(h[k]);
    mx = std::max(mx, std::fabs(h[k]));
    if (exact[k] != 1) mx_int8 = std::max(mx_int8, std::fabs(h[k]));
  }
  if (!finite || mx > kMaxMagnitude) return false;
  for (int64_t e = 0; e < p.num_exact; ++e) w.hx[r * p.num_exact + e] = h[p.exact_dims[e]];
  float inv = 0.0f;
  const float hs = int8_scale(mx_int8, &inv);
  int32_t sum = 0, sum_abs = 0;
  int64_t sum_sq = 0;
  double err = 0.0;
  int8_t* q = w.hq.data() + r * w.padded_hidden;
  for (int64_t k = 0; k < p.hidden; ++k) {
    if (exact[k] == 1) continue;   // q stays 0: no int8 part, no error
    const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, std::nearbyint(h[k] * inv))));
    q[k] = static_cast<int8_t>(v);
    sum += v;
    sum_abs += v < 0 ? -v : v;
    sum_sq += v * v;
    const double d = static_cast<double>(h[k]) - static_cast<double>(hs) * v;
    err += d * d;
  }
  w.offset[r] = 128 * sum;
  w.hscale[r] = hs;
  w.u[r] = kBoundScale * hs;
  w.v[r] = kBoundScale * (hs * static_cast<float>(sum_abs));
  w.pn[r] = kNormScale * static_cast<float>(std::sqrt(err));
  w.qn[r] = kNormScale * static_cast<float>(hs * std::sqrt(static_cast<double>(sum_sq)));
  w.r[r] = (kRoundingSlack + kExactDimSlack * static_cast<float>(p.num_exact)) * mx;
  return true;
}

// Appends to p.outliers the dims of row r (not exact, not reported yet) where |h| exceeds
// outlier_ratio x the row's RMS, marking them exact[k] = 2; returns the new count.
int64_t report_outliers(const GreedyHeadParams& p, std::vector<char>& exact, int64_t r,
                        int64_t found) {
  const float* h = p.hidden_states + r * p.hidden_stride;
  double sq = 0.0;
  for (int64_t k = 0; k < p.hidden; ++k) sq += static_cast<double>(h[k]) * h[k];
  const double limit = p.outlier_ratio * std::sqrt(sq / static_cast<double>(p.hidden));
  for (int64_t k = 0; k < p.hidden && found < p.max_outliers; ++k) {
    if (std::fabs(h[k]) > limit && !exact[k]) {
      exact[k] = 2;     // reported (not scored exactly in this call)
      p.outliers[found++] = static_cast<int32_t>(k);
    }
  }
  return found;
}

// Pass 1: scores and bounds of every (row, tile), each thread over its own run of tiles.
void score_all_tiles(const Work& w, std::vector<Slice>& slices, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    score_tiles(w, w.tiles * t / n, w.tiles * (t + 1) / n, slices[t]);
  }
}

// What pass 2 found for one hidden row.
struct RowResult {
  enum class Kind { kToken, kOverCap, kNoCandidate };
  Kind kind = Kind::kToken;
  int64_t token = 0;          // kToken: the argmax of the exact logits
  int64_t num_candidates = 0; // vocab rows whose score + bound reached the row's floor
  int64_t num_rescored = 0;   // exact logits computed for the row
};

// The lowest value whose bf16 rounding is at least that of x (the midpoint between x's bf16 value
// and the bf16 value below it), less 2^-20 of |x| for the float arithmetic: a logit below it
// cannot round to x's bf16 value or above.
inline float bf16_bucket_floor(float x) {
  if (!std::isfinite(x)) return x;
  const uint16_t h = float_to_bf16(x);
  const float b = bf16_to_float(h);
  const uint16_t below = b > 0.0f ? static_cast<uint16_t>(h - 1)
                                  : (b < 0.0f ? static_cast<uint16_t>(h + 1) : uint16_t{0x8001});
  return 0.5f * (b + bf16_to_float(below)) - std::fabs(x) * (1.0f / 1048576.0f);
}

// Row r's candidates from every slice whose score + bound reaches `floor`, as (hi, j), largest
// hi first (the lowest j first among equal hi); false when a slice gave up on the row or there
// are more than `cap`.
bool gather_candidates(const std::vector<Slice>& slices, int64_t r, float floor, int64_t cap,
                       std::vector<std::pair<float, int32_t>>& picked) {
  for (const Slice& s : slices) {
    const Candidates& c = s.cands[r];
    if (c.over) return false;
    for (int64_t i = 0; i < c.n; ++i)
      if (c.hi[i] >= floor) picked.emplace_back(c.hi[i], c.j[i]);
  }
  if (static_cast<int64_t>(picked.size()) > cap) return false;
  std::sort(picked.begin(), picked.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  return true;
}

// Pass 2 for hidden row r: exact logits of the candidates, largest upper bound first, until the
// next bound is below the best exact logit found (fp32: below it; bf16: below the lowest value
// that rounds to its bf16 value): no later candidate can then win or tie. The largest wins, the
// lowest index on a tie. On random 1B-shape data (vocab 128256, hidden 2048) this computes ~20
// exact logits a row out of ~300 candidates; visiting them in index order computed them all, and
// finding them took a second int8 pass over each tile that could hold one (a row's worth of
// weight bytes re-read from DRAM per hidden row: 30 ms of the 1B head's 16-row step).
// Past `cap` candidates the row is left to the caller.
RowResult rescore_row(const Work& w, const std::vector<Slice>& slices, int64_t r, int64_t cap) {
  const GreedyHeadParams& p = w.p;
  const bool bf16 = p.weight_dtype == DType::kBFloat16;
  float floor_lo = -INFINITY;
  for (const Slice& s : slices) floor_lo = std::max(floor_lo, s.best_lo[r]);
  // bf16: a row whose exact logit is below the best one may still round to the same bf16 value
  // (and win by a lower index): take every candidate that reaches the best one's bf16 bucket.
  if (bf16) floor_lo = std::min(floor_lo, bf16_bucket_floor(floor_lo));
  thread_local std::vector<std::pair<float, int32_t>> picked;
  picked.clear();
  RowResult res;
  if (!gather_candidates(slices, r, floor_lo, cap, picked)) {
    res.kind = RowResult::Kind::kOverCap;
    return res;
  }
  res.num_candidates = static_cast<int64_t>(picked.size());
  const float* h = p.hidden_states + r * p.hidden_stride;
  thread_local std::vector<double> hd;
  hd.assign((p.hidden + 15) / 16 * 16, 0.0);
  for (int64_t k = 0; k < p.hidden; ++k) hd[k] = h[k];
  thread_local std::vector<float> row;
  if (bf16) row.resize(p.hidden);
  const int64_t row_bytes = p.hidden * (bf16 ? 2 : 4);
  const char* base = static_cast<const char*>(p.weight);
  const int64_t stride_bytes = p.weight_stride * (bf16 ? 2 : 4);
  float best = -INFINITY, stop = -INFINITY;   // stop: a bound below it cannot win or tie
  bool any = false;
  for (size_t i = 0; i < picked.size(); ++i) {
    const auto [hi, j] = picked[i];
    if (any && hi < stop) break;
    if (i + 1 < picked.size()) {    // the next row's lines, while this one is summed
      const char* next = base + picked[i + 1].second * stride_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 0, 0);
    }
    float e;
    if (bf16) {
      const uint16_t* wj = static_cast<const uint16_t*>(p.weight) + j * p.weight_stride;
      for (int64_t k = 0; k < p.hidden; ++k) row[k] = bf16_to_float(wj[k]);
      e = bf16_to_float(float_to_bf16(exact_logit_of(hd.data(), row.data(), p.hidden)));
    } else {
      e = exact_logit_of(hd.data(), static_cast<const float*>(p.weight) + j * p.weight_stride,
                         p.hidden);
    }
    ++res.num_rescored;
    if (!any || e > best || (e == best && j < res.token)) {
      best = e, res.token = j, any = true;
      stop = bf16 ? bf16_bucket_floor(best) : best;
    }
  }
  if (!any) res.kind = RowResult::Kind::kNoCandidate;  // cannot happen: the floor's row passes
  return res;
}

// Up to kChunkRows hidden rows: quantise, pass 1, pass 2.
Status greedy_head_rows(const GreedyHeadParams& p) {
  Work w(p);
  std::vector<char> exact;   // per hidden dim: 1 exact, 2 reported as an outlier in this call
  if (const Status st = init_work(p, w, exact); !st.ok()) return st;
  const int64_t rows = p.num_rows;
  const bool report = p.outlier_ratio > 0.0f && p.max_outliers > 0 && p.outliers && p.num_outliers;
  int64_t found = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (!quantize_row(p, w, exact, r))
      return Status::Error("greedy_head: a hidden state is not finite (or > 1e15)");
    if (report) found = report_outliers(p, exact, r, found);
  }
  if (report) *p.num_outliers = found;

  const int64_t cap = p.max_rescored_per_row > 0 ? p.max_rescored_per_row : p.vocab;
  w.cap = cap;
  w.bf16 = p.weight_dtype == DType::kBFloat16;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads(), w.tiles)));
  std::vector<Slice> slices(threads, Slice(rows));
  score_all_tiles(w, slices, threads);

  int64_t rescored = 0, candidates = 0;
  bool lost = false;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : rescored, candidates) reduction(|| : lost) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const RowResult res = rescore_row(w, slices, r, cap);
    p.out[r] = res.kind == RowResult::Kind::kToken ? res.token : -1;
    rescored += res.num_rescored;
    candidates += res.num_candidates;
    lost = lost || res.kind == RowResult::Kind::kNoCandidate;
  }
  if (p.num_rescored) *p.num_rescored = rescored;
  if (p.num_candidates) *p.num_candidates = candidates;
  if (lost) return Status::Error("greedy_head: internal error, a row kept no candidate");
  return Status::Ok();
}

}  // namespace

Status greedy_head(const GreedyHeadParams& p) {
  if (p.num_rows < 0 || p.vocab <= 0 || p.hidden <= 0 || p.hidden_stride < p.hidden ||
      p.weight_stride < p.hidden)
    return Status::Error("greedy_head: need num_rows >= 0, vocab > 0, hidden > 0 and strides >= hidden");
  if (p.num_rows == 0) return Status::Ok();
  if (!p.hidden_states || !p.packed || !p.row_stats || !p.weight || !p.out)
    return Status::Error("greedy_head: null pointer");
  if (p.weight_dtype != DType::kFloat32 && p.weight_dtype != DType::kBFloat16)
    return Status::Error("greedy_head: the weight must be float32 or bfloat16");
  // Up to kChunkRows hidden rows per pass over the weight (a decode step's rows fit one pass;
  // the per-call scratch stays small for any batch).
  int64_t rescored = 0, found = 0, candidates = 0;
  for (int64_t r0 = 0; r0 < p.num_rows; r0 += kChunkRows) {
    GreedyHeadParams c = p;
    c.hidden_states = p.hidden_states + r0 * p.hidden_stride;
    c.num_rows = std::min(kChunkRows, p.num_rows - r0);
    c.out = p.out + r0;
    int64_t chunk_rescored = 0, chunk_found = 0, chunk_candidates = 0;
    c.num_rescored = &chunk_rescored;
    c.num_candidates = &chunk_candidates;
    c.num_outliers = &chunk_found;
    if (p.outliers) {
      c.outliers = p.outliers + found;
      c.max_outliers = p.max_outliers - found;
    }
    const Status st = greedy_head_rows(c);
    if (!st.ok()) return st;
    rescored += chunk_rescored;
    found += chunk_found;
    candidates += chunk_candidates;
  }
  if (p.num_rescored) *p.num_rescored = rescored;
  if (p.num_candidates) *p.num_candidates = candidates;
  if (p.num_outliers) *p.num_outliers = found;
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512_vnni {
Status greedy_head(const GreedyHeadParams& p);
}
#endif

// Packing has no ISA-specific path: built once.
namespace cpu {
using namespace CBK_CPU_NS;  // the constants and helpers above
Status greedy_head_pack(const GreedyHeadPackParams& p) {
  if (p.vocab <= 0 || p.hidden <= 0 || p.weight_stride < p.hidden)
    return Status::Error("greedy_head_pack: need vocab > 0, hidden > 0, weight_stride >= hidden");
  // int32 sums of K products of at most 255 x 127 cannot wrap for K <= 65536.
  if (p.vocab > INT32_MAX || p.hidden > kMaxHidden)
    return Status::Error("greedy_head_pack: vocab must fit int32 and hidden be <= 65536");
  if (!p.weight || !p.packed || !p.row_stats) return Status::Error("greedy_head_pack: null pointer");
  if (p.weight_dtype != DType::kFloat32 && p.weight_dtype != DType::kBFloat16)
    return Status::Error("greedy_head_pack: the weight must be float32 or bfloat16");
  const bool bf16 = p.weight_dtype == DType::kBFloat16;
  const int64_t padded = greedy_head_padded_vocab(p.vocab);
  const int64_t groups = greedy_head_padded_hidden(p.hidden) / 4;
  float *scale = p.row_stats, *l1s = scale + padded, *l2s = l1s + padded, *errs = l2s + padded;
  std::memset(p.packed, 128, static_cast<size_t>(greedy_head_packed_bytes(p.vocab, p.hidden)));
  constexpr float kUp = 1.0f + 1.0f / 1048576.0f;   // rounds a norm computed in double up
  bool bad = false;
#pragma omp parallel for schedule(static) num_threads(max_threads()) reduction(|| : bad)
  for (int64_t j = 0; j < padded; ++j) {
    if (j >= p.vocab) {
      scale[j] = l1s[j] = l2s[j] = errs[j] = 0.0f;
      continue;
    }
    thread_local std::vector<float> converted;
    const float* w;
    if (bf16) {
      converted.resize(p.hidden);
      const uint16_t* src = static_cast<const uint16_t*>(p.weight) + j * p.weight_stride;
      for (int64_t k = 0; k < p.hidden; ++k) converted[k] = bf16_to_float(src[k]);
      w = converted.data();
    } else {
      w = static_cast<const float*>(p.weight) + j * p.weight_stride;
    }
    float mx = 0.0f;
    double l1 = 0.0, l2 = 0.0;
    for (int64_t k = 0; k < p.hidden; ++k) {
      bad = bad || !std::isfinite(w[k]);
      mx = std::max(mx, std::fabs(w[k]));
      l1 += std::fabs(w[k]);
      l2 += static_cast<double>(w[k]) * w[k];
    }
    bad = bad || mx > kMaxMagnitude;
    float inv = 0.0f;
    scale[j] = int8_scale(mx, &inv);
    l1s[j] = static_cast<float>(l1) * kUp;
    l2s[j] = static_cast<float>(std::sqrt(l2)) * kUp;
    errs[j] = 0.0f;
    if (mx == 0.0f) continue;
    double err = 0.0;
    for (int64_t k = 0; k < p.hidden; ++k) {
      const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(w[k] * inv)));
      p.packed[packed_offset(j, k, groups)] = static_cast<uint8_t>(static_cast<int>(q) + 128);
      const double d = static_cast<double>(w[k]) - static_cast<double>(scale[j]) * q;
      err += d * d;
    }
    errs[j] = static_cast<float>(std::sqrt(err)) * kUp;
  }
  if (bad) return Status::Error("greedy_head_pack: the weight holds a non-finite or huge (> 1e15) value");
  return Status::Ok();
}

// The run-time pick (cb_kernels/isa.h): bodies portable and avx512_vnni.
Isa greedy_head_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx512Vnni}); }

Status greedy_head(const GreedyHeadParams& p, Isa isa) {
#if CBK_X86_BODIES
  if (greedy_head_isa(isa) == Isa::kAvx512Vnni) return cpu_avx512_vnni::greedy_head(p);
#endif
  return cpu_portable::greedy_head(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
