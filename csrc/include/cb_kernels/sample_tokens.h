// Sampling of one token per row of fp32 logits, with the drawn token's logprob. Torch-free.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// Per row r (rows independent; the result never depends on the other rows or the threads):
//   m = max(x), y = (x - m) / temperature[r]       (fp32, as torch's sub and div)
//   q_j = trunc(exp(y_j) * 2^kSampleMassBits)      (exact integer masses, fp32 exp to ~1 ulp)
//   out[r] = the first j whose running sum of q passes floor(u[r] * sum(q))
//   lse[r] = log(sum(q) / 2^kSampleMassBits), logprobs[r] = y_out - lse
// The sums are exact integers, so a row drawn over its top-k candidates (the other columns'
// masses are 0) picks the token it would pick over the whole row, in any order of addition.
// A row holding NaN, +inf, or only -inf gives the first NaN (else the first maximum) and NaN
// logprob and lse.
constexpr int kSampleMassBits = 40;        // the largest mass (the row's maximum) is 2^40
constexpr int64_t kSampleMaxCols = int64_t{1} << 22;  // sums stay below 2^62

struct SampleTokensParams {
  const float* logits = nullptr;       // [num_rows, num_cols], rows row_stride apart
  const float* temperature = nullptr;  // [num_rows] (> 0), or nullptr: 1 for every row
  const float* u = nullptr;            // [num_rows] uniforms in (0, 1)
  int64_t* out = nullptr;              // [num_rows] token ids
  float* logprobs = nullptr;           // [num_rows] or nullptr
  float* lse = nullptr;                // [num_rows] or nullptr
  int64_t num_rows = 0;
  int64_t num_cols = 0;                // 1 .. kSampleMaxCols
  int64_t row_stride = 0;              // >= num_cols
};

namespace cpu {
// Bodies: portable, avx512 (see cb_kernels/isa.h); both give the same bits.
Status sample_tokens(const SampleTokensParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
