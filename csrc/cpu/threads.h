// One thread count for the CPU kernels, process-wide.
//
// omp_set_num_threads() sets a per-thread OpenMP variable: a count set from the Python thread that
// first called an op would not reach kernels called from any other thread, which would then use
// every core. The binding stores the count here instead and each parallel region asks for it.
#pragma once

#include <omp.h>

#include <atomic>

namespace cbk {
namespace cpu {

inline std::atomic<int>& thread_setting() {  // 0: OpenMP's default
  static std::atomic<int> n{0};
  return n;
}

inline int max_threads() {
  const int n = thread_setting().load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_max_threads();
}

}  // namespace cpu
}  // namespace cbk
