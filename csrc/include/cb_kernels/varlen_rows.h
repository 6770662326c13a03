// The variable-length batch every stateful op takes (gated_delta.h, selective_scan.h,
// causal_conv1d.h): the step's rows in packed-token order, each with the state slot it reads and
// writes in place. The Python wrappers check the values (slots in range and distinct,
// cu_seqlens from 0 to num_tokens, non-decreasing); check_rows() checks what C++ can.
#pragma once

#include <cstdint>

#include "cb_kernels/common.h"

namespace cbk {

struct VarlenRows {
  const int64_t* slots = nullptr;         // [num_seqs], each in [0, num_slots), distinct
  const int32_t* cu_seqlens = nullptr;    // [num_seqs + 1]: row s is tokens [cu[s], cu[s + 1])
  const uint8_t* has_state = nullptr;     // [num_seqs]: 1 continue from the slot, 0 from zeros
  int64_t num_seqs = 0, num_slots = 0;

  int64_t num_tokens() const { return num_seqs > 0 ? cu_seqlens[num_seqs] : 0; }
};

// Ok, or the error for counts that cannot be right or a missing index array (only when there
// are rows: an empty batch may pass null pointers).
inline Status check_rows(const VarlenRows& r) {
  if (r.num_seqs < 0 || r.num_slots < 0)
    return Status::Error("varlen rows: num_seqs and num_slots must be >= 0");
  if (r.num_seqs > 0 && (!r.slots || !r.cu_seqlens || !r.has_state))
    return Status::Error("varlen rows: null slots, cu_seqlens or has_state");
  return Status::Ok();
}

}  // namespace cbk
