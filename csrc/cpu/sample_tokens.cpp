// One drawn token per row of fp32 logits and its logprob (see cb_kernels/sample_tokens.h).
//
// Why a kernel: the sampler's torch path for a GRPO step (512 rows of SmolLM2's 49152 logits at
// temperature 1 with processed logprobs) made [rows, vocab] temporaries in five passes (shift
// and scale, log_softmax, exp, cumsum, searchsorted): ~95 ms of a ~900 ms step on the 2-core
// Zen 4 machine at 2 threads. Here a row is read twice (its maximum; then the masses, summed per
// block of kBlock columns) and a third time over one block to find the drawn column, with no
// temporary the size of the row.
//
// Masses are integers, trunc(exp(y) * 2^40), summed exactly: the draw cannot depend on the order
// of additions, so the same row gives the same token over its top-k candidates (the other
// columns' masses are 0), in one thread or many, in the portable or the AVX-512 body. exp is
// Cephes' expf scheme (Cody-Waite reduction, degree-7 polynomial, ~1 ulp) written with the same
// fused multiply-adds in both bodies, so both give the same bits. Values below -80 count as -80:
// their mass truncates to 0 either way, and every intermediate stays a normal float (no
// dependence on the flush-to-zero mode).
#include "cb_kernels/sample_tokens.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "threads.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define CBK_SAMPLE_AVX512 1
#include <immintrin.h>
#else
#define CBK_SAMPLE_AVX512 0
#endif

namespace cbk {
namespace CBK_CPU_NS {
namespace {

constexpr int64_t kBlock = 256;                  // columns per partial sum of the masses
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;           // ln 2 = kLn2Hi + kLn2Lo (Cephes)
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kFloor = -80.0f;
constexpr float kScale = static_cast<float>(int64_t{1} << kSampleMassBits);
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// y = (x - m) / t, as torch's sub then div (no division at t == 1: x / 1 == x).
inline float shifted(float x, float m, float t, bool divide) {
  const float y = x - m;
  return divide ? y / t : y;
}

// The integer mass of y <= 0 (or -inf): trunc(exp(y) * 2^40).
inline int64_t mass_of(float y) {
  y = y > kFloor ? y : kFloor;
  const float n = std::nearbyint(y * kLog2e);
  float r = std::fma(n, -kLn2Hi, y);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float e = std::ldexp(std::fma(p, r * r, r) + 1.0f, static_cast<int>(n));
  return static_cast<int64_t>(e * kScale);
}

#if CBK_SAMPLE_AVX512
// x: [n]. The largest value; *nan is set when the row holds a NaN.
float row_max(const float* x, int64_t n, bool* nan) {
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
  __mmask16 bad = 0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
    bad |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + j);
    bad |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
  }
  *nan = bad != 0;
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

// The 16 masses of x[0..16) (lanes outside `k` give 0), as mass_of, added into lo/hi.
inline void add_masses(const float* x, __mmask16 k, __m512 m, __m512 t, bool divide, __m512i* lo,
                       __m512i* hi) {
  __m512 y = _mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x), m);
  if (divide) y = _mm512_div_ps(y, t);
  y = _mm512_max_ps(y, _mm512_set1_ps(kFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), y);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512 e = _mm512_mul_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(kScale));
  *lo = _mm512_add_epi64(*lo, _mm512_cvttps_epi64(_mm512_castps512_ps256(e)));
  *hi = _mm512_add_epi64(*hi, _mm512_cvttps_epi64(_mm512_extractf32x8_ps(e, 1)));
}

// The sum of the masses of x[j0..j1).
int64_t mass_sum(const float* x, int64_t j0, int64_t j1, float m, float t, bool divide) {
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(t);
  __m512i lo = _mm512_setzero_si512(), hi = lo;
  for (int64_t j = j0; j < j1; j += 16) {
    const __mmask16 k = j1 - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (j1 - j)) - 1u);
    add_masses(x + j, k, vm, vt, divide, &lo, &hi);
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}
#else
float row_max(const float* x, int64_t n, bool* nan) {
  float m = -INFINITY;
  bool bad = false;
  for (int64_t j = 0; j < n; ++j) {
    bad = bad || x[j] != x[j];
    m = x[j] > m ? x[j] : m;
  }
  *nan = bad;
  return m;
}

int64_t mass_sum(const float* x, int64_t j0, int64_t j1, float m, float t, bool divide) {
  int64_t s = 0;
  for (int64_t j = j0; j < j1; ++j) s += mass_of(shifted(x[j], m, t, divide));
  return s;
}
#endif

// floor(u * total) for u in (0, 1), exactly (u's 24-bit significand times total in 128 bits);
// clamped to [0, total - 1].
int64_t target_of(float u, int64_t total) {
  if (!(u > 0.0f)) return 0;
  if (!(u < 1.0f)) return total - 1;
  int e = 0;
  const float f = std::frexp(u, &e);                     // u = f * 2^e, f in [0.5, 1), e <= 0
  const auto sig = static_cast<unsigned __int128>(std::ldexp(f, 24));
  const int shift = 24 - e;
  const unsigned __int128 prod = sig * static_cast<unsigned __int128>(total);
  const int64_t t = shift >= 128 ? 0 : static_cast<int64_t>(prod >> shift);
  return std::min(t, total - 1);
}

// One row: x [n]; blocks: scratch of at least ceil(n / kBlock) sums.
void sample_row(const SampleTokensParams& p, int64_t r, std::vector<int64_t>& blocks) {
  const float* x = p.logits + r * p.row_stride;
  const int64_t n = p.num_cols;
  const float t = p.temperature ? p.temperature[r] : 1.0f;
  bool nan = false;
  const float m = row_max(x, n, &nan);
  if (nan || std::isinf(m)) {        // no distribution: the first NaN, else the first maximum
    int64_t at = 0;
    while (at < n && !(nan ? x[at] != x[at] : x[at] == m)) ++at;
    p.out[r] = at;
    if (p.logprobs) p.logprobs[r] = std::numeric_limits<float>::quiet_NaN();
    if (p.lse) p.lse[r] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const bool divide = t != 1.0f;
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  if (static_cast<int64_t>(blocks.size()) < num_blocks) blocks.resize(num_blocks);
  int64_t total = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    blocks[b] = mass_sum(x, b * kBlock, std::min(n, (b + 1) * kBlock), m, t, divide);
    total += blocks[b];
  }
  // total >= 2^40: the maximum's mass. The drawn column is the first whose running sum passes
  // the target; it has a mass > 0.
  const int64_t target = target_of(p.u[r], total);
  int64_t cum = 0, b = 0;
  while (cum + blocks[b] <= target) cum += blocks[b++];
  int64_t at = b * kBlock;
  for (const int64_t end = std::min(n, at + kBlock); at < end; ++at) {
    cum += mass_of(shifted(x[at], m, t, divide));
    if (cum > target) break;
  }
  p.out[r] = at;
  const float lse = static_cast<float>(std::log(static_cast<double>(total)) -
                                       kSampleMassBits * 0.69314718055994530942);
  if (p.lse) p.lse[r] = lse;
  if (p.logprobs) p.logprobs[r] = shifted(x[at], m, t, divide) - lse;
}

}  // namespace

Status sample_tokens(const SampleTokensParams& p) {
  if (p.num_rows < 0 || p.num_cols <= 0 || p.num_cols > kSampleMaxCols || p.row_stride < p.num_cols)
    return Status::Error(
        "sample_tokens: need num_rows >= 0, 0 < num_cols <= 2^22, row_stride >= num_cols");
  if (p.num_rows == 0) return Status::Ok();
  if (!p.logits || !p.u || !p.out) return Status::Error("sample_tokens: null pointer");
  // A thread per row pays off from about 64k values (as greedy_tokens).
  const bool parallel = p.num_rows > 1 && p.num_rows * p.num_cols >= (1 << 16);
#pragma omp parallel num_threads(cpu::max_threads()) if (parallel)
  {
    std::vector<int64_t> blocks;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.num_rows; ++r) sample_row(p, r, blocks);
  }
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
// The run-time pick (cb_kernels/isa.h): bodies portable and avx512.
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status sample_tokens(const SampleTokensParams& p);
}
#endif

namespace cpu {
Status sample_tokens(const SampleTokensParams& p, Isa isa) {
#if CBK_X86_BODIES
  constexpr Isa kBodies[] = {Isa::kPortable, Isa::kAvx512};
  if (pick(isa, kBodies) == Isa::kAvx512) return cpu_avx512::sample_tokens(p);
#endif
  return cpu_portable::sample_tokens(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
