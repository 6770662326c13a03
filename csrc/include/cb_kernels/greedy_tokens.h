// Greedy sampling: the index of the largest value of each row of fp32 logits. Torch-free.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// out[r] = the first index of the largest value of row r; a row holding NaN gives the index of
// its first NaN (torch.argmax's rule: NaN is larger than everything).
struct GreedyTokensParams {
  const float* logits = nullptr;  // [num_rows, num_cols], each row packed
  int64_t* out = nullptr;         // [num_rows]
  int64_t num_rows = 0;
  int64_t num_cols = 0;           // > 0
  int64_t row_stride = 0;         // elements between rows (>= num_cols)
};

namespace cpu {
// Bodies: portable, avx2 (see cb_kernels/isa.h).
Status greedy_tokens(const GreedyTokensParams& p, Isa isa = Isa::kAuto);
}  // namespace cpu

}  // namespace cbk
