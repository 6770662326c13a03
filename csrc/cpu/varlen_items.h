// The work split the varlen stateful kernels share (gated_delta.cpp, selective_scan.cpp,
// causal_conv1d.cpp): one work item is one (row, part) pair, a part being a head (the scans) or
// a block of channels (the conv). Items are independent (each owns its slice of the state and
// of the output), so how they are split over threads never changes a result: a row's outputs
// do not depend on the batch or the thread count.
//
// Threads are gated on the call's work, not on its item count: a decode step of a small model
// costs a few microseconds, less than waking the OpenMP team (~5-20 us on the 2-core Zen 4, far
// more when another process holds the second core: the barrier then waits for a time slice), so
// it runs on the calling thread. Above the gate each thread gets at least min_work_per_thread.
// Rows are visited longest first (a prefill row's items cost its length, a decode row's one
// token): with dynamic scheduling the long items start first and the short ones fill the gaps,
// so a step that mixes one long prompt with many decodes does not end on one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "threads.h"

namespace cbk {
namespace cpu {
// Internal linkage: this header is compiled with each ISA's flags (portable, avx512), and an
// inline function the linker merged across those objects could hand the portable body AVX-512
// code.
namespace {

// Threads for a call of `work` units (multiply-adds) over `items` independent items.
inline int threads_for(int64_t work, int64_t items, int64_t min_work_per_thread) {
  const int64_t by_work = work / std::max<int64_t>(min_work_per_thread, 1);
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(max_threads()), items, by_work})));
}

// Calls fn(s, part) for every row s < num_seqs and part < num_parts, the rows longest first
// (cu_seqlens [num_seqs + 1]), on threads_for(work, items, min_work_per_thread) threads.
template <typename Fn>
void for_each_row_part(const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_parts,
                       int64_t work, int64_t min_work_per_thread, Fn&& fn) {
  const int64_t items = num_seqs * num_parts;
  if (items <= 0) return;
  const int threads = threads_for(work, items, min_work_per_thread);
  if (threads == 1) {
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t part = 0; part < num_parts; ++part) fn(s, part);
    return;
  }
  std::vector<int64_t> order(static_cast<size_t>(num_seqs));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cu_seqlens[a + 1] - cu_seqlens[a] > cu_seqlens[b + 1] - cu_seqlens[b];
  });
  // Chunks of items, ~16 per thread: one item a grab made the threads fight over the loop
  // counter's cache line when items are tiny (a decode's conv: 1088 items of ~150 ns for 16 rows
  // x 4352 channels, 164 us on one thread and 186-242 us on two, Zen 4); 16 chunks a thread
  // still let the short items fill in behind the long ones.
  const int64_t chunk = std::max<int64_t>(1, items / (int64_t{16} * threads));
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
  for (int64_t it = 0; it < items; ++it) fn(order[it / num_parts], it % num_parts);
}

}  // namespace
}  // namespace cpu
}  // namespace cbk
