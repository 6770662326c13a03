// Register-tile helpers shared by the CPU GEMM kernels (linear.cpp, linear_bf16.cpp).
// Include only from a csrc/cpu/*.cpp (built once per ISA body, cb_kernels/isa.h).
#pragma once

#include <omp.h>

#include <algorithm>
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

// A GEMM's work over the threads: rows in equal chunks of at most max_chunk_rows (128 rows: 2 x
// 64, not 96 + 32, which would leave one of two threads a third of the work), items (row chunk,
// panel) split statically, row chunks outermost, so each thread walks the panels in memory order.
// In the thread: pack(r0, rows) once per chunk it reaches (its rows of x into the register
// blocks' layout), then run(r0, rows, panel) per item. `serial`: one thread does all.
template <class Pack, class Run>
inline void for_each_panel_item(int64_t m, int64_t panels, int64_t max_chunk_rows, bool serial,
                                int threads, Pack pack, Run run) {
  const int64_t chunks = (m + max_chunk_rows - 1) / max_chunk_rows;
  const int64_t chunk_rows = (m + chunks - 1) / chunks;
  const int64_t items = chunks * panels;
#pragma omp parallel num_threads(threads) if (!serial)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t packed_chunk = -1;
    for (int64_t item = items * t / nt; item < items * (t + 1) / nt; ++item) {
      const int64_t chunk = item / panels, r0 = chunk * chunk_rows;
      const int64_t rows = std::min(chunk_rows, m - r0);
      if (chunk != packed_chunk) {
        pack(r0, rows);
        packed_chunk = chunk;
      }
      run(r0, rows, item % panels);
    }
  }
}

// The rows of a decode step (one chunk) over the threads: every thread used to pack the whole
// chunk for its share of the panels (SmolLM2's down at 64 rows: ~30 us of packing in a ~100 us
// call, each thread doing it). Here the threads pack the row blocks of the chunk together into
// one buffer (block b by thread b mod threads), meet at a barrier, then split the panels as
// for_each_panel_item does. pack_block(r0, rows): rows [r0, r0 + rows) of one register block.
template <class PackBlock, class Run>
inline void for_each_panel_shared_rows(int64_t m, int64_t panels, int64_t block_rows, int threads,
                                       PackBlock pack_block, Run run) {
  const int64_t blocks = (m + block_rows - 1) / block_rows;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t b = t; b < blocks; b += nt)
      pack_block(b * block_rows, std::min(block_rows, m - b * block_rows));
#pragma omp barrier
    for (int64_t pi = panels * t / nt; pi < panels * (t + 1) / nt; ++pi) run(pi);
  }
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
