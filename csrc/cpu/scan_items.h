// What the two state scans share (gated_delta.cpp, selective_scan.cpp): element loads and stores
// of their dtypes, and the run over their work items, one (row, head) each, on
// cpu::for_each_row_part (varlen_items.h: threads gated on the call's work, longest rows first).
// Compiled into each ISA body (CBK_CPU_NS), with internal linkage as varlen_items.h says why.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cb_kernels/common.h"
#include "varlen_items.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// State-element updates (tokens x heads x state elements) a thread must get before a second one
// joins: 2^16 (~15 us of the gated delta rule's avx512 body) is about what waking the OpenMP
// team costs.
constexpr int64_t kScanWorkPerThread = int64_t{1} << 16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }

// item(s, h, T{}) for every row s of p.rows and head h < num_heads, T the element type of
// p.dtype (uint16_t for bf16, else float); state_elems: a head's state elements.
template <typename Params, typename Item>
Status run_scan_items(const Params& p, int64_t num_heads, int64_t state_elems, Item&& item) {
  const int64_t work = std::max<int64_t>(p.rows.num_tokens(), 1) * num_heads * state_elems;
  const bool bf16 = p.dtype == DType::kBFloat16;
  cpu::for_each_row_part(p.rows.cu_seqlens, p.rows.num_seqs, num_heads, work,
                         kScanWorkPerThread, [&](int64_t s, int64_t h) {
                           bf16 ? item(s, h, uint16_t{}) : item(s, h, float{});
                         });
  return Status::Ok();
}

}  // namespace
}  // namespace CBK_CPU_NS
}  // namespace cbk
