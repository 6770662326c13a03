// fp32 linear on a packed weight (see cb_kernels/linear.h for the layout and the result rule).
//
// Why our own: the engine's decode steps multiply few rows (16-64) by every weight of the model,
// where oneDNN's packed fp32 GEMM stays well below the core's FMA peak. Measured on the 2-core
// Zen 4 bench machine, one thread, SmolLM2-135M's linears (30 layers of q/k/v 576->960, o
// 576->576, gate/up 576->3072, down 1536->576, 425 MB streamed): 16 rows 36-38 ms here against
// 45-50 ms for oneDNN; 512 rows (2 layers) 66 ms (95% of the FMA peak) against 69-78 ms; two
// threads, 16 rows: 20.7-21.7 ms against 25-29 ms. The AVX2 body (forced on the same machine)
// reaches only 0.65x oneDNN at 16 rows and 0.87x at 512, so the engine uses oneDNN on AVX2-only
// CPUs (ops/linear.py, PackedLinear.fast()); the body stays, for them and for the tests.
//
// The register tile keeps MR rows x 32 columns of y in registers (AVX-512: 12 x 2 zmm; AVX2:
// 6 rows x 16 columns, 2 ymm, per half panel); each k step loads the panel's line(s) once and
// broadcasts one x value per row. Work items are (row chunk, panel), split statically over the
// threads. The file is built portable, avx2 and avx512 (cb_kernels/isa.h); the flags of each
// compile pick its register tile (CBK_LINEAR_BODY), the rest of the code is the same.
#include "cb_kernels/linear.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_tiles.h"
#include "threads.h"

// The body this compile builds (see cb_kernels/isa.h): the flags of the ISA pick it.
#if defined(__AVX512F__)
#define CBK_LINEAR_BODY 2
#elif defined(__AVX2__) && defined(__FMA__)
#define CBK_LINEAR_BODY 1
#else
#define CBK_LINEAR_BODY 0
#endif
#if CBK_LINEAR_BODY > 0
#include <immintrin.h>
#endif

namespace cbk {
namespace CBK_CPU_NS {
using cpu::max_threads;
namespace {

constexpr int64_t kP = kLinearPanel;
constexpr int64_t kChunkRows = 96;              // rows per work item (a multiple of 12 and 6)
constexpr int64_t kSerialWork = 1 << 16;        // below this many FMAs one thread does all
// A packed weight above kStreamedBytes cannot stay in the L3 (32 MiB on the Zen 4 bench
// machine, shared) between row chunks: each chunk streams it from memory again. An LM head
// ([49152, 576], 113 MB) at 512 rows in 96-row chunks read it 6 times a step and ran at 80% of
// the FMA rate the L3-resident decoder weights reach. For such a weight, once every thread has
// rows enough for a full chunk, each thread takes its share of the rows as one chunk (packed
// once, its x at most kPackBytes so it stays in the L2 beside a panel) and streams the weight
// once. Each output is still one FMA chain over k: only the work order changes.
constexpr int64_t kStreamedBytes = 16ll << 20;
constexpr int64_t kPackBytes = 768ll << 10;

// Rows per work item for an [m, k] x [k, n] product on `threads` threads (see kStreamedBytes).
int64_t chunk_rows(int64_t m, int64_t n, int64_t k, int threads, int64_t mr) {
  const int64_t weight_bytes = (n + kP - 1) / kP * kP * k * static_cast<int64_t>(sizeof(float));
  if (weight_bytes <= kStreamedBytes || m < threads * kChunkRows) return kChunkRows;
  const int64_t cap = std::max<int64_t>(kChunkRows, kPackBytes / (k * sizeof(float)) / mr * mr);
  return std::min(cap, (m + threads - 1) / threads);
}

#if CBK_LINEAR_BODY == 0
// Columns [c0, c0 + cols) of panel `wp` for rows [0, rows) of x: plain loops, std::fma in k
// order (the SIMD bodies' arithmetic). x: [rows, k], rows x_stride apart; wp: [k][kP];
// y: [rows, cols], rows y_stride apart.
void panel_generic(const LinearParams& p, const float* x, int64_t rows, const float* wp,
                   int64_t col0, int64_t cols, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < p.k; ++k) acc = std::fma(x[r * p.x_stride + k], wp[k * kP + c], acc);
      y[r * p.y_stride + c] = p.bias ? acc + p.bias[col0 + c] : acc;
    }
  }
}
#endif


#if CBK_LINEAR_BODY > 0
// Rows [0, rows) of x (row stride ld) into blocks of `mr` rows, each [k][rows in block]: block
// b starts at b * mr * k.
void pack_rows(const float* x, int64_t ld, int64_t rows, int64_t k, int64_t mr, float* xp) {
  for (int64_t b0 = 0; b0 < rows; b0 += mr) {
    const int64_t n = std::min(mr, rows - b0);
    float* dst = xp + b0 * k;
    for (int64_t r = 0; r < n; ++r) {
      const float* src = x + (b0 + r) * ld;
      for (int64_t kk = 0; kk < k; ++kk) dst[kk * n + r] = src[kk];
    }
  }
}
#endif

#if CBK_LINEAR_BODY == 2
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wall reports as
// uninitialised: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// xp: the MR rows of x packed k-major, [K][MR]: one k step's broadcasts read one line.
// wp: [K][kP] (one panel); y: [MR, cols], rows y_stride apart.
template <int MR>
void tile_avx512(const LinearParams& p, const float* xp, const float* wp,
                                   int64_t col0, int64_t cols, float* y) {
  const __mmask16 m0 = static_cast<__mmask16>(cols >= 16 ? 0xffff : (1u << cols) - 1u);
  const __mmask16 m1 = static_cast<__mmask16>(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1u);
  __m512 a0[MR], a1[MR];   // two arrays: one [MR][2] array GCC keeps in memory
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wp + k * kP), w1 = _mm512_loadu_ps(wp + k * kP + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(xp[k * MR + r]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
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
    _mm512_mask_storeu_ps(y + r * p.y_stride, m0, o0);
    _mm512_mask_storeu_ps(y + r * p.y_stride + 16, m1, o1);
  }
}

// xp: the chunk's rows packed by pack_rows(.., 12, ..); wp: [K][kP]; y: [rows, cols].
void panel_avx512(const LinearParams& p, const float* xp, int64_t rows,
                                    const float* wp, int64_t col0, int64_t cols, float* y) {
  int64_t r = 0;
  for (; r + 12 <= rows; r += 12) tile_avx512<12>(p, xp + r * p.k, wp, col0, cols, y + r * p.y_stride);
  with_rows<11>(rows - r, [&](auto mr) {
    tile_avx512<decltype(mr)::value>(p, xp + r * p.k, wp, col0, cols, y + r * p.y_stride);
  });
}

#pragma GCC diagnostic pop
#endif

#if CBK_LINEAR_BODY == 1
// Half a panel (16 columns at wp) for MR rows: 2 ymm per row; xp, wp, y as in tile_avx512.
template <int MR>
void tile_avx2(const LinearParams& p, const float* xp, const float* wp,
                               int64_t col0, int64_t cols, float* y) {
  __m256 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.k; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * kP), w1 = _mm256_loadu_ps(wp + k * kP + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xp + k * MR + r);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  }
  // Masked stores straight from the registers: spilling the accumulators to a local array for
  // the store made GCC keep all 12 in memory inside the k loop (2.3x slower).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lane);
  const bool bias = p.bias != nullptr;
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (bias) {
    b0 = _mm256_maskload_ps(p.bias + col0, m0);
    b1 = _mm256_maskload_ps(p.bias + col0 + 8, m1);
  }
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * p.y_stride;
    _mm256_maskstore_ps(yr, m0, bias ? _mm256_add_ps(a0[r], b0) : a0[r]);
    _mm256_maskstore_ps(yr + 8, m1, bias ? _mm256_add_ps(a1[r], b1) : a1[r]);
  }
}

// xp: the chunk's rows packed by pack_rows(.., 6, ..); wp: [K][kP]; y: [rows, cols].
void panel_avx2(const LinearParams& p, const float* xp, int64_t rows,
                                const float* wp, int64_t col0, int64_t cols, float* y) {
  for (int64_t half = 0; half < 2 && half * 16 < cols; ++half) {
    const float* w = wp + half * 16;
    const int64_t c0 = col0 + half * 16, n = std::min<int64_t>(16, cols - half * 16);
    float* yh = y + half * 16;
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) tile_avx2<6>(p, xp + r * p.k, w, c0, n, yh + r * p.y_stride);
    with_rows<5>(rows - r, [&](auto mr) {
      tile_avx2<decltype(mr)::value>(p, xp + r * p.k, w, c0, n, yh + r * p.y_stride);
    });
  }
}
#endif

}  // namespace

Status linear(const LinearParams& p) {
  if (p.m < 0 || p.k <= 0 || p.n <= 0 || p.x_stride < p.k || p.y_stride < p.n)
    return Status::Error("linear: need m >= 0, k > 0, n > 0, x_stride >= k, y_stride >= n");
  if (p.m == 0) return Status::Ok();
  if (!p.x || !p.packed || !p.y) return Status::Error("linear: null pointer");
  // Each thread packs its chunk's rows of x (k-major per register block) once per chunk.
  thread_local std::vector<float> xpack;
  constexpr int64_t mr = CBK_LINEAR_BODY == 2 ? 12 : 6;
  auto pack = [&](int64_t r0, int64_t rows) {
#if CBK_LINEAR_BODY == 0
    (void)r0, (void)rows, (void)mr;     // the plain loops read x in place
#else
    if (xpack.size() < static_cast<size_t>(rows * p.k)) xpack.resize(rows * p.k);
    pack_rows(p.x + r0 * p.x_stride, p.x_stride, rows, p.k, mr, xpack.data());
#endif
  };
  auto run = [&](int64_t r0, int64_t rows, int64_t pi) {
    const int64_t col0 = pi * kP, cols = std::min(kP, p.n - col0);
    const float* wp = p.packed + pi * p.k * kP;
    float* y = p.y + r0 * p.y_stride + col0;
#if CBK_LINEAR_BODY == 0
    panel_generic(p, p.x + r0 * p.x_stride, rows, wp, col0, cols, y);
#elif CBK_LINEAR_BODY == 2
    panel_avx512(p, xpack.data(), rows, wp, col0, cols, y);
#else
    panel_avx2(p, xpack.data(), rows, wp, col0, cols, y);
#endif
  };
  const int threads = max_threads();
  for_each_panel_item(p.m, (p.n + kP - 1) / kP, chunk_rows(p.m, p.n, p.k, threads, mr),
                      p.m * p.n * p.k < kSerialWork, threads, pack, run);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx2 {
Status linear(const LinearParams& p);
}
namespace cpu_avx512 {
Status linear(const LinearParams& p);
}
#endif

// Packing has no ISA-specific path: built once.
namespace cpu {
using namespace CBK_CPU_NS;  // the constants and helpers above
Status linear_pack(const LinearPackParams& p) {
  if (p.n <= 0 || p.k <= 0 || p.weight_stride < p.k)
    return Status::Error("linear_pack: need n > 0, k > 0, weight_stride >= k");
  if (!p.weight || !p.packed) return Status::Error("linear_pack: null pointer");
  const int64_t panels = (p.n + kP - 1) / kP;
#pragma omp parallel for schedule(static) num_threads(max_threads())
  for (int64_t pi = 0; pi < panels; ++pi) {
    float* dst = p.packed + pi * p.k * kP;
    for (int64_t c = 0; c < kP; ++c) {
      const int64_t row = pi * kP + c;
      if (row >= p.n) {
        for (int64_t k = 0; k < p.k; ++k) dst[k * kP + c] = 0.0f;
        continue;
      }
      const float* src = p.weight + row * p.weight_stride;
      for (int64_t k = 0; k < p.k; ++k) dst[k * kP + c] = src[k];
    }
  }
  return Status::Ok();
}

// The run-time pick (cb_kernels/isa.h): bodies portable, avx2 and avx512.
Isa linear_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}); }

Status linear(const LinearParams& p, Isa isa) {
#if CBK_X86_BODIES
  switch (linear_isa(isa)) {
    case Isa::kAvx512: return cpu_avx512::linear(p);
    case Isa::kAvx2: return cpu_avx2::linear(p);
    default: break;
  }
#endif
  return cpu_portable::linear(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
