// The register tile of the bf16 GEMMs (linear_bf16.cpp, moe_experts.cpp): MR rows x up to 32
// columns of fp32 sums over one packed bf16 panel (cb_kernels/linear.h's layout, [pairs][32][2])
// and MR x rows packed in k pairs ([pairs][MR] 32-bit words, the odd element in the high half).
// With AVX512-BF16 one vdpbf16ps per 16 outputs and pair; in plain C++ the same two adds per
// pair, the odd element's product first (each product exact in fp32): the same bits. Include
// only from a csrc/cpu/*.cpp (built once per ISA body, cb_kernels/isa.h).
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"
#include "cb_kernels/linear.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cbk {
namespace CBK_CPU_NS {
namespace {

#if defined(__AVX512F__)
// The store masks of a tile of `cols` (<= 32) columns: its first and its second 16.
inline void tile_masks(int64_t cols, __mmask16& m0, __mmask16& m1) {
  m0 = static_cast<__mmask16>(cols >= 16 ? 0xffff : (1u << cols) - 1u);
  m1 = static_cast<__mmask16>(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1u);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// a0[r] / a1[r]: columns 0-15 / 16-31 of row r, summed over the pairs from zero.
template <int MR>
inline void bf16_tile_sums(const uint32_t* xp, int64_t pairs, const uint16_t* wp, __m512 (&a0)[MR],
                           __m512 (&a1)[MR]) {
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + i * kLinearPanel * 2);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + i * kLinearPanel * 2 + 32);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i * MR + r]));
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, xb);
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, xb);
    }
  }
}
#pragma GCC diagnostic pop
#else
// Row r, column c of the tile, as vdpbf16ps sums it.
inline float bf16_tile_sum(const uint32_t* xp, int mr, int r, int64_t pairs, const uint16_t* wp,
                           int64_t c) {
  float acc = 0.0f;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint32_t xv = xp[i * mr + r];
    const uint16_t* w = wp + (i * kLinearPanel + c) * 2;
    acc += bf16_to_float(w[1]) * bf16_to_float(static_cast<uint16_t>(xv >> 16));
    acc += bf16_to_float(w[0]) * bf16_to_float(static_cast<uint16_t>(xv & 0xffffu));
  }
  return acc;
}
#endif

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
