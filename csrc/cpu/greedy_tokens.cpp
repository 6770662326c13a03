// Greedy sampling on CPU (see cb_kernels/greedy_tokens.h).
//
// Why a kernel: torch.argmax over a [32, 32000] fp32 logits tensor took 0.9 ms on one thread of
// the 2-core bench machine, 8% of a tiny Llama's decode step. One pass per row: two 8-lane
// accumulators keep each lane's maximum and the index where it first appeared; a NaN is noted on
// the side and, when seen, a scalar scan finds the first one.
#include "cb_kernels/greedy_tokens.h"

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_vec.h"
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// x: [n].
int64_t argmax_row(const float* x, int64_t n) {
  float best = -INFINITY;
  int64_t best_at = n;  // none yet
  bool nan = false;
  int64_t j = 0;
  if (n >= 16 && n <= INT32_MAX) {
    // Two accumulators; each lane keeps its maximum and where it first saw it (strict >).
    v8f m0 = load8(x), m1 = load8(x + 8);
    v8i i0 = v8i{0, 1, 2, 3, 4, 5, 6, 7}, i1 = i0 + 8;
    v8i at0 = i0, at1 = i1;
    v8i bad = (m0 != m0) | (m1 != m1);
    for (j = 16; j + 16 <= n; j += 16) {
      i0 += 16;
      i1 += 16;
      const v8f a = load8(x + j), b = load8(x + j + 8);
      bad |= (a != a) | (b != b);
      const v8i ga = a > m0, gb = b > m1;
      m0 = ga ? a : m0;
      at0 = ga ? i0 : at0;
      m1 = gb ? b : m1;
      at1 = gb ? i1 : at1;
    }
    // Across lanes: the largest value and, among lanes holding it, the smallest index.
    for (int l = 0; l < 8; ++l) {
      nan = nan || bad[l] != 0;
      const float v[2] = {m0[l], m1[l]};
      const int64_t at[2] = {at0[l], at1[l]};
      for (int k = 0; k < 2; ++k) {
        if (v[k] > best || (v[k] == best && at[k] < best_at)) {
          best = v[k];
          best_at = at[k];
        }
      }
    }
  }
  for (; j < n; ++j) {  // later indices than any above: strict > keeps the first maximum
    nan = nan || std::isnan(x[j]);
    if (x[j] > best || best_at == n) {
      best = x[j];
      best_at = j;
    }
  }
  if (nan) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  return best_at;
}

}  // namespace

Status greedy_tokens(const GreedyTokensParams& p) {
  if (p.num_rows < 0 || p.num_cols <= 0 || p.row_stride < p.num_cols)
    return Status::Error("greedy_tokens: need num_rows >= 0, num_cols > 0, row_stride >= num_cols");
  if (p.num_rows == 0) return Status::Ok();
  if (p.logits == nullptr || p.out == nullptr) return Status::Error("greedy_tokens: null pointer");
  // A thread per row pays off from about 64k values a row-set (~30 us of scanning).
  const bool parallel = p.num_rows > 1 && p.num_rows * p.num_cols >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel)
  for (int64_t r = 0; r < p.num_rows; ++r) p.out[r] = argmax_row(p.logits + r * p.row_stride, p.num_cols);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
// The run-time pick (cb_kernels/isa.h): bodies portable and avx2.
#if CBK_X86_BODIES
namespace cpu_avx2 {
Status greedy_tokens(const GreedyTokensParams& p);
}
#endif

namespace cpu {
Status greedy_tokens(const GreedyTokensParams& p, Isa isa) {
#if CBK_X86_BODIES
  constexpr Isa kBodies[] = {Isa::kPortable, Isa::kAvx2};
  if (pick(isa, kBodies) == Isa::kAvx2) return cpu_avx2::greedy_tokens(p);
#endif
  return cpu_portable::greedy_tokens(p);
}
}  // namespace cpu
#endif

}  // namespace cbk

