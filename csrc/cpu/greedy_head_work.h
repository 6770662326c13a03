// The per-call state of the CPU greedy head and the pieces both of its bodies (greedy_head.cpp's
// portable one, greedy_head_vnni.h) share: tile sizes, bound constants, the int8 scale, the
// packed weight's layout and the fixed-order fold of the exact logit. greedy_head.cpp's opening
// comment gives the bound these constants serve. Internal to that file's translation unit.
#pragma once

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
constexpr int kRowBlock = 4;      // hidden rows per register block (4 x 4 accumulators)
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
  // [rows, tiles]: the largest score + bound of each (hidden row, tile). Pass 2 recomputes the
  // 64 scores of only the tiles that reach the row's floor: storing every score (rows x vocab
  // floats) cost ~0.3 ms of DRAM traffic a call in the engine, 39 MB for 64 x 152k.
  float* tile_hi = nullptr;
  std::vector<float> hx;         // [rows, num_exact]: h at the exact dims
  int64_t padded_vocab = 0;
  explicit Work(const GreedyHeadParams& params) : p(params) {}
};

// The largest score - bound of each hidden row over one thread's tiles.
struct Slice {
  std::vector<float> best_lo;    // [rows]
  explicit Slice(int64_t rows) : best_lo(rows, -INFINITY) {}
};

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
