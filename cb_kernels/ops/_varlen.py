"""The variable-length batch every stateful op takes (gated_delta_rule, selective_scan,
causal_conv1d): slots int64 [num_seqs], cu_seqlens int32 [num_seqs + 1], has_state bool
[num_seqs]. Its checks, and the one argument the bindings take for it (python/varlen_rows_arg.h).
"""
from __future__ import annotations

import torch

from cb_kernels.ops._backend import check_tensor


def check_varlen(slots, cu_seqlens, has_state) -> None:
    """Types and shapes of the three index tensors."""
    check_tensor(slots, "slots", ndim=1, dtype=torch.int64, contiguous=True)
    check_tensor(cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, contiguous=True)
    check_tensor(has_state, "has_state", ndim=1, dtype=torch.bool, contiguous=True)
    if cu_seqlens.shape[0] != slots.shape[0] + 1 or has_state.shape[0] != slots.shape[0]:
        raise ValueError(f"cu_seqlens must have num_seqs + 1 entries and has_state num_seqs, "
                         f"got {cu_seqlens.shape[0]} and {has_state.shape[0]} for "
                         f"{slots.shape[0]} slots")


def check_values(state, slots, cu_seqlens, num_tokens: int) -> None:
    """The index values against `state` ([num_slots, ...]) and the token count (one host read
    of slots and cu_seqlens)."""
    s = slots.tolist()
    if any(x < 0 or x >= state.shape[0] for x in s):
        raise ValueError(f"slots must lie in [0, {state.shape[0]}) (state's num_slots), got {s}")
    if len(set(s)) != len(s):
        raise ValueError(f"slots must be distinct (each row owns its state), got {s}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at num_tokens={num_tokens} and not "
                         f"decrease, got {cu}")


def rows_arg(slots, cu_seqlens, has_state, num_slots: int) -> tuple:
    """The bindings' `rows` argument: (slots, cu_seqlens, has_state data pointers, num_seqs,
    num_slots)."""
    return (slots.data_ptr(), cu_seqlens.data_ptr(), has_state.data_ptr(), slots.shape[0],
            num_slots)
