// The `rows` argument of the stateful ops' bindings (gated_delta_rule, selective_scan,
// causal_conv1d): one tuple (slots, cu_seqlens, has_state data pointers, num_seqs, num_slots),
// built by cb_kernels/ops/_varlen.py's rows_arg, which checks its values first.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>

#include "bindings.h"
#include "cb_kernels/varlen_rows.h"

namespace cbk {

using VarlenRowsArg = std::tuple<uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>;

inline VarlenRows as_rows(const VarlenRowsArg& a) {
  VarlenRows r;
  r.slots = as_ptr<const int64_t>(std::get<0>(a));
  r.cu_seqlens = as_ptr<const int32_t>(std::get<1>(a));
  r.has_state = as_ptr<const uint8_t>(std::get<2>(a));
  r.num_seqs = std::get<3>(a);
  r.num_slots = std::get<4>(a);
  return r;
}

}  // namespace cbk
