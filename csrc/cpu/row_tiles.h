// Register-tile helpers shared by the CPU GEMM kernels (linear.cpp, linear_bf16.cpp).
// Include only from a csrc/cpu/*.cpp (built once per ISA body, cb_kernels/isa.h).
#pragma once

#include <cstdint>
#include <type_traits>

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// f(std::integral_constant<int, n>) for a run-time n in [1, N]: the register tiles of a chunk's
// last rows.
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N)
      f(std::integral_constant<int, N>{});
    else
      with_rows<N - 1>(n, f);
  }
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
