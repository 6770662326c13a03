// bf16 linear on a packed bf16 weight (see cb_kernels/linear.h for the layout and the result
// rule): the engine's bf16 linears where the CPU has AVX512-BF16.
//
// Why our own: decode steps multiply few rows (16-64) by every weight, a stream of the weights
// through the cores. oneDNN's bf16 matmul (brg_matmul:avx512_core_bf16, through torch's mkldnn
// ops) left SmolLM2-135M's bf16 engine at 16 rows slower than its fp32 engine on our fp32 kernel
// (2-core Zen 4, same day: 241 against 289 tok/s). Here, as in linear.cpp, a register tile holds
// MR rows x 32 columns of y (12 x 2 zmm); each k pair loads the panel's line (128 bytes: 32
// columns x 2 k) once and broadcasts one bf16 pair per row: one vdpbf16ps per 16 outputs and 2 k.
// The file is built portable and avx512_bf16 (cb_kernels/isa.h); the portable body does the
// same adds in the same order.
#include "cb_kernels/linear.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_tile.h"
#include "row_tiles.h"
#include "threads.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CBK_LINEAR_BF16_SIMD 1
#include <immintrin.h>
#else
#define CBK_LINEAR_BF16_SIMD 0
#endif

namespace cbk {
namespace CBK_CPU_NS {
using cpu::max_threads;
namespace {

constexpr int64_t kP = kLinearPanel;
constexpr int64_t kChunkRows = 96;              // rows per work item (a multiple of 12)
constexpr int64_t kSerialWork = 1 << 16;        // below this many products one thread does all
constexpr int64_t kMR = 12;


// Rows [0, rows) of x into blocks of kMR rows, each [k pairs][rows in block] of 32-bit bf16
// pairs (an odd k's last pair padded with 0): block b starts at b * kMR * pairs.
void pack_rows(const uint16_t* x, int64_t ld, int64_t rows, int64_t k, uint32_t* xp) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t b0 = 0; b0 < rows; b0 += kMR) {
    const int64_t n = std::min(kMR, rows - b0);
    uint32_t* dst = xp + b0 * pairs;
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* src = x + (b0 + r) * ld;
      for (int64_t i = 0; i < k / 2; ++i) {     // a pair is the row's 32-bit word i (little-endian)
        uint32_t v;
        std::memcpy(&v, src + 2 * i, 4);
        dst[i * n + r] = v;
      }
      if (k % 2) dst[(pairs - 1) * n + r] = src[k - 1];
    }
  }
}

#if !CBK_LINEAR_BF16_SIMD
// The tile in plain C++ (bf16_tile.h's sums), then the bias.
template <int MR>
void tile(const LinearBf16Params& p, const uint32_t* xp, const uint16_t* wp, int64_t col0,
          int64_t cols, uint16_t* y) {
  const int64_t pairs = (p.k + 1) / 2;
  for (int r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = bf16_tile_sum(xp, MR, r, pairs, wp, c);
      if (p.bias) acc += p.bias[col0 + c];
      y[r * p.y_stride + c] = float_to_bf16(acc);
    }
  }
}
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int MR>
void tile(const LinearBf16Params& p, const uint32_t* xp, const uint16_t* wp, int64_t col0,
          int64_t cols, uint16_t* y) {
  __mmask16 m0, m1;
  tile_masks(cols, m0, m1);
  __m512 a0[MR], a1[MR];
  bf16_tile_sums<MR>(xp, (p.k + 1) / 2, wp, a0, a1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const bool bias = p.bias != nullptr;
  if (bias) {
    b0 = _mm512_maskz_loadu_ps(m0, p.bias + col0);
    b1 = _mm512_maskz_loadu_ps(m1, p.bias + col0 + 16);
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 o0 = bias ? _mm512_add_ps(a0[r], b0) : a0[r];
    const __m512 o1 = bias ? _mm512_add_ps(a1[r], b1) : a1[r];
    _mm256_mask_storeu_epi16(y + r * p.y_stride, m0, (__m256i)_mm512_cvtneps_pbh(o0));
    _mm256_mask_storeu_epi16(y + r * p.y_stride + 16, m1, (__m256i)_mm512_cvtneps_pbh(o1));
  }
}
#pragma GCC diagnostic pop
#endif

// xp: the chunk's rows packed by pack_rows; wp: one panel; y: [rows, cols].
void panel(const LinearBf16Params& p, const uint32_t* xp, int64_t rows, const uint16_t* wp,
           int64_t col0, int64_t cols, uint16_t* y) {
  const int64_t pairs = (p.k + 1) / 2;
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) tile<kMR>(p, xp + r * pairs, wp, col0, cols, y + r * p.y_stride);
  with_rows<kMR - 1>(rows - r, [&](auto mr) {
    tile<decltype(mr)::value>(p, xp + r * pairs, wp, col0, cols, y + r * p.y_stride);
  });
}

}  // namespace

Status linear_bf16(const LinearBf16Params& p) {
  if (p.m < 0 || p.k <= 0 || p.n <= 0 || p.x_stride < p.k || p.y_stride < p.n)
    return Status::Error("linear_bf16: need m >= 0, k > 0, n > 0, x_stride >= k, y_stride >= n");
  if (p.m == 0) return Status::Ok();
  if (!p.x || !p.packed || !p.y) return Status::Error("linear_bf16: null pointer");
  const int64_t pairs = (p.k + 1) / 2;
  thread_local std::vector<uint32_t> xpack;     // as linear.cpp: x packed once per chunk
  auto pack = [&](int64_t r0, int64_t rows) {
    if (xpack.size() < static_cast<size_t>(rows * pairs)) xpack.resize(rows * pairs);
    pack_rows(p.x + r0 * p.x_stride, p.x_stride, rows, p.k, xpack.data());
  };
  auto run = [&](int64_t r0, int64_t rows, int64_t pi) {
    const int64_t col0 = pi * kP, cols = std::min(kP, p.n - col0);
    panel(p, xpack.data(), rows, p.packed + pi * pairs * kP * 2, col0, cols,
          p.y + r0 * p.y_stride + col0);
  };
  const int64_t panels = (p.n + kP - 1) / kP;
  const bool serial = p.m * p.n * p.k < kSerialWork;
  const int threads = max_threads();
  if (p.m <= kChunkRows && !serial && threads > 1 && panels > 1) {
    // One chunk of rows (decode): packed once, by all threads, into the caller's buffer. SmolLM2's
    // 120 linears at 64 rows, 2 threads, Zen 4: 34.8-35.6 ms against 35.9-36.5 with each thread
    // packing the whole chunk (three alternating runs, 2026-12-06); same bits.
    thread_local std::vector<uint32_t> shared;
    if (shared.size() < static_cast<size_t>(p.m * pairs)) shared.resize(p.m * pairs);
    uint32_t* xs = shared.data();
    for_each_panel_shared_rows(
        p.m, panels, kMR, threads,
        [&](int64_t r0, int64_t rows) {
          pack_rows(p.x + r0 * p.x_stride, p.x_stride, rows, p.k, xs + r0 * pairs);
        },
        [&](int64_t pi) {
          const int64_t col0 = pi * kP, cols = std::min(kP, p.n - col0);
          panel(p, xs, p.m, p.packed + pi * pairs * kP * 2, col0, cols, p.y + col0);
        });
    return Status::Ok();
  }
  for_each_panel_item(p.m, panels, kChunkRows, serial, threads, pack, run);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512_bf16 {
Status linear_bf16(const LinearBf16Params& p);
}
#endif

namespace cpu {
Status linear_bf16_pack(const LinearBf16PackParams& p) {
  if (p.n <= 0 || p.k <= 0 || p.weight_stride < p.k)
    return Status::Error("linear_bf16_pack: need n > 0, k > 0, weight_stride >= k");
  if (!p.weight || !p.packed) return Status::Error("linear_bf16_pack: null pointer");
  const int64_t panels = (p.n + kLinearPanel - 1) / kLinearPanel, pairs = (p.k + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(max_threads())
  for (int64_t pi = 0; pi < panels; ++pi) {
    uint16_t* dst = p.packed + pi * pairs * kLinearPanel * 2;
    for (int64_t c = 0; c < kLinearPanel; ++c) {
      const int64_t row = pi * kLinearPanel + c;
      const uint16_t* src = row < p.n ? p.weight + row * p.weight_stride : nullptr;
      for (int64_t i = 0; i < pairs; ++i)
        for (int e = 0; e < 2; ++e) {
          const int64_t k = 2 * i + e;
          dst[(i * kLinearPanel + c) * 2 + e] = src && k < p.k ? src[k] : uint16_t{0};
        }
    }
  }
  return Status::Ok();
}

// The run-time pick (cb_kernels/isa.h): bodies portable and avx512_bf16.
Isa linear_bf16_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx512Bf16}); }

Status linear_bf16(const LinearBf16Params& p, Isa isa) {
#if CBK_X86_BODIES
  if (linear_bf16_isa(isa) == Isa::kAvx512Bf16) return cpu_avx512_bf16::linear_bf16(p);
#endif
  return cpu_portable::linear_bf16(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
