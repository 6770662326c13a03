// The per-call state of the CPU greedy head and the pieces both of its bodies (greedy_head.cpp's
// portable one, greedy_head_vnni.h) share: tile sizes, bound constants, the int8 scale, the
// packed weight's layout and the fixed-order fold of the exact logit. greedy_head.cpp's opening
// comment gives the bound these constants serve. Internal to that file's translation unit.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cb_kernels/greedy_head.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {
constexpr int64_t kTile = 64;     // vocab rows per tile: 4 blocks of 16 lanes
// Inputs up to 1e15 keep every product, sum and bound finite in fp32 (65536 x 1e30 < 3e38).
constexpr float kMaxMagnitude = 1e15f;
constexpr int64_t kMaxHidden = 65536;
constexpr int64_t kChunkRows = 64;  // hidden rows per pass over the weight
// Hidden rows per register block: 6 x 4 accumulators + 4 weight vectors + the broadcast fill 29
// of the 32 zmm registers and load each weight vector for 6 rows, not 4 (one thread, Zen 4,
// alternating runs: SmolLM2's head 16 rows 2.78-2.88 against 3.05-3.18 ms, 64 rows 1.01x, the
// 1B head at 64 rows 83-84 against 86-99 ms). The int32 dot products are exact either way.
constexpr int kRowBlock = 6;
constexpr float kBoundScale = 0.5005f;             // the 1/2 of the bound, plus 0.1%
constexpr float kNormScale = 1.001f;                // the Cauchy-Schwarz bounds, plus 0.1%
constexpr float kRoundingSlack = 1.0f / 262144.0f;  // 2^-18, times max|h| ||w_j||_1
// Each exact dim adds one fp32 rounding (<= 2^-24 max|h| ||w_j||_1) to the score: budgeted
// twice over, on top of the 2^-18, so 64 exact dims stay as safe as 8.
constexpr float kExactDimSlack = 1.0f / 8388608.0f;  // 2^-23
constexpr float kTinySlack = 1e-30f;                // absolute, for subnormal corners

// The int8 scale of a vector whose largest magnitude is mx, and its inverse. Below 127 FLT_MIN,
// 127 / mx overflows fp32 (every value would quantise to +-127 and 0 to NaN -> -127, far past the
// half step the bound assumes) and mx / 127 is subnormal: the scale is then FLT_MIN, whose inverse
// 2^126 is exact, so each value still rounds to within half a step.
inline float int8_scale(float mx, float* inv) {
  const float s = mx / 127.0f;
  if (mx == 0.0f) {
    *inv = 0.0f;
    return 0.0f;
  }
  if (s < FLT_MIN) {
    *inv = 1.0f / FLT_MIN;
    return FLT_MIN;
  }
  *inv = 127.0f / mx;
  return s;
}

inline int64_t packed_offset(int64_t j, int64_t k, int64_t groups) {
  return (((j / kTile) * groups + k / 4) * kTile + j % kTile) * 4 + k % 4;
}

// <h, w_j> in double: float products are exact there. 16 partial sums (lane k % 16), folded in a
// fixed order and rounded once to float; exact_logit_avx512 keeps the same 16 sums in two
// vectors, so both bodies return the same float. s: [16] partial sums.
inline float fold_sums(const double* s) {
  double t[8];
  for (int i = 0; i < 8; ++i) t[i] = s[i] + s[i + 8];
  return static_cast<float>(((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7])));
}

// Per-call state shared by the passes.
struct Work {
  const GreedyHeadParams& p;
  int64_t padded_hidden, groups, tiles;
  std::vector<int8_t> hq;        // [rows, padded_hidden]
  std::vector<int32_t> offset;   // 128 * sum(hq row): the +128 of the packed bytes
  std::vector<float> hscale;
  // Per hidden row, the factors of the bound: b_j = min(u l1_j, p l2_j) + min(v s_j, q err_j)
  // + r l1_j (row_stats: scale s_j, l1, l2, err).
  std::vector<float> u, v, pn, qn, r;
  const float *scale = nullptr, *l1 = nullptr, *l2 = nullptr, *err = nullptr;
  std::vector<float> hx;         // [rows, num_exact]: h at the exact dims
  int64_t padded_vocab = 0;
  int64_t cap = 0;               // candidates a row may keep before it is left to the caller
  bool bf16 = false;             // a bf16 weight: pass 2's floor drops to the bf16 bucket
  explicit Work(const GreedyHeadParams& params) : p(params) {}
};

// The vocab rows of one hidden row that one thread's tiles left in the running: those whose
// score + bound (hi) reached the row's largest score - bound seen so far. The final floor is at
// least that, so the list holds every candidate of those tiles (and some that the final floor
// drops). Pass 1 writes up to a tile's 64 entries at a time (16-lane stores in the VNNI body):
// reserve(k) makes room for k entries past n.
struct Candidates {
  std::vector<int32_t> j;
  std::vector<float> hi;
  int64_t n = 0;
  int64_t compact_at = 1024;     // n that triggers a compaction against the running floor
  bool over = false;             // kept more than the cap after a compaction: left to the caller
  void reserve(int64_t k) {
    if (static_cast<int64_t>(j.size()) < n + k) {
      const size_t size = static_cast<size_t>(std::max<int64_t>(128, 2 * (n + k)));
      j.resize(size);
      hi.resize(size);
    }
  }
  // Drops the entries below `floor` (a floor only rises); past `cap` entries the row is over.
  void compact(float floor, int64_t cap) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i)
      if (hi[i] >= floor) j[k] = j[i], hi[k] = hi[i], ++k;
    n = k;
    compact_at = std::max<int64_t>(1024, 2 * n);
    if (n > cap) over = true, n = 0;
  }
};

// One thread's view of pass 1: per hidden row the largest score - bound over its tiles, and
// the candidates among them.
struct Slice {
  std::vector<float> best_lo;    // [rows]
  std::vector<Candidates> cands; // [rows]
  explicit Slice(int64_t rows) : best_lo(rows, -INFINITY), cands(rows) {}
};

// The floor pass 1 keeps candidates against, given a row's running L: L for an fp32 weight; for
// a bf16 one below the lowest value rounding to L's bf16 value (pass 2's floor, which lies
// within 2^-7 |L| plus 2^-20 |L| of L, or one bf16 subnormal step of 0). Both never fall as L
// rises, so what pass 1 drops is below pass 2's floor too.
inline float pass1_floor(const Work& w, float L) {
  return w.bf16 ? L - std::fabs(L) * (1.0f / 64.0f) - 1e-38f : L;
}

// After a tile: keeps row `row`'s list short (entries that can no longer reach the floor go).
inline void after_append(const Work& w, Slice* s, int64_t row) {
  Candidates& c = s->cands[row];
  if (c.n >= c.compact_at) c.compact(pass1_floor(w, s->best_lo[row]), w.cap);
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
