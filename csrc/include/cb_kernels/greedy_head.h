// Greedy LM head: the argmax token of hidden @ W^T without computing every fp32 logit. Torch-free.
//
// A greedy step needs only the index of each row's largest logit. The kernel scores every vocab
// row with int8 dot products (per-row scales; AVX-512 VNNI does 64 of them per instruction, 4x
// the fp32 FMA rate) and knows, for each score, a bound on how far it can be from the exact
// logit. Only the rows whose score plus bound reaches the best score minus bound can hold the
// maximum; those few are recomputed exactly (fp32 inputs, double sums) and the largest wins, the
// lowest index on a tie. So the result is the argmax of exact logits, not of approximations.
// A bf16 weight (weight_dtype kBFloat16) is read as its exact fp32 values, and the argmax is
// then that of the exact logits rounded to bf16 (the lowest index among equal bf16 values), the
// same rule as the argmax of a bf16 GEMM's logits, up to the GEMM's fp32 rounding.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

namespace cbk {

// Layout of a packed head: vocab rows in tiles of 64; per tile, for every group of 4 hidden
// dims, 4 blocks of 16 rows x 4 bytes (the operand of one VNNI instruction per block). A byte is
// the row's int8 weight + 128. Padded rows and dims hold 128 (weight 0).
inline int64_t greedy_head_padded_vocab(int64_t vocab) { return (vocab + 63) / 64 * 64; }
inline int64_t greedy_head_padded_hidden(int64_t hidden) { return (hidden + 3) / 4 * 4; }
inline int64_t greedy_head_packed_bytes(int64_t vocab, int64_t hidden) {
  return greedy_head_padded_vocab(vocab) * greedy_head_padded_hidden(hidden);
}

constexpr int64_t kGreedyHeadRowStats = 4;

struct GreedyHeadPackParams {
  const void* weight = nullptr;   // [vocab, hidden], rows `weight_stride` apart, finite
  DType weight_dtype = DType::kFloat32;   // kFloat32 or kBFloat16
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t weight_stride = 0;
  uint8_t* packed = nullptr;      // [greedy_head_packed_bytes(vocab, hidden)]
  // [kGreedyHeadRowStats, padded vocab], 0 for padding: per vocab row its int8 scale
  // max|w_j| / 127 (FLT_MIN if that is smaller, 0 for a zero row), then ||w_j||_1, ||w_j||_2
  // and ||w_j - w~_j||_2 (rounded up).
  float* row_stats = nullptr;
};

struct GreedyHeadParams {
  const float* hidden_states = nullptr;  // [num_rows, hidden], rows `hidden_stride` apart
  int64_t num_rows = 0;
  int64_t hidden_stride = 0;
  // The packed head and the fp32 weight it was packed from (read for the exact rescoring).
  const uint8_t* packed = nullptr;
  const float* row_stats = nullptr;
  const void* weight = nullptr;
  DType weight_dtype = DType::kFloat32;   // kBFloat16: the argmax of bf16-rounded exact logits
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t weight_stride = 0;
  // Hidden dims scored exactly instead of in int8 (a few huge "massive activation" dims would
  // otherwise set the int8 scale of the whole row): their indices, and the head's columns for
  // them, [num_exact, padded vocab] fp32 (zeros past vocab).
  const int32_t* exact_dims = nullptr;
  const float* exact_cols = nullptr;
  int64_t num_exact = 0;
  // Optional report of candidates for exact dims: dims (not exact yet) where some row's |h|
  // exceeds outlier_ratio x the row's RMS, each once, up to max_outliers (0: no report).
  float outlier_ratio = 0.0f;
  int32_t* outliers = nullptr;
  int64_t max_outliers = 0;
  int64_t* num_outliers = nullptr;
  int64_t* out = nullptr;            // [num_rows] token ids; -1: the row passed the cap
  // A hidden row whose bound leaves more than this many vocab rows to rescore gets out = -1
  // (the caller computes it in fp32: cheaper than that many exact rescorings); 0: no cap.
  int64_t max_rescored_per_row = 0;
  int64_t* num_rescored = nullptr;   // optional: how many logits were computed exactly, in all
  int64_t* num_candidates = nullptr; // optional: vocab rows the bound left in the running, in all
};

namespace cpu {
Status greedy_head_pack(const GreedyHeadPackParams& p);
// Fails (Status) on a non-finite hidden state: the caller then takes the fp32 path, whose argmax
// has torch's NaN rule.
// Bodies: portable, avx512_vnni (see cb_kernels/isa.h); both give the same tokens.
Status greedy_head(const GreedyHeadParams& p, Isa isa = Isa::kAuto);
Isa greedy_head_isa(Isa isa = Isa::kAuto);  // the body greedy_head(p, isa) runs on this machine
}  // namespace cpu

}  // namespace cbk
