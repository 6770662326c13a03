"""`selective_scan`: the Mamba-2 selective scan (SSD recurrence) over a variable-length batch,
each row's state read from and written back to its slot in place; one call runs every row of a
step (decodes and prefills mixed). Backends: "cpu" (csrc/cpu/selective_scan.cpp, fp32 or bf16
inputs, fp32 state), "triton" (cb_kernels/triton/selective_scan.py: CUDA, or CPU tensors under
TRITON_INTERPRET=1) and "torch" (ops/reference.py's ref_selective_scan).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import (DTYPE_CODES, check_tensor, default_cuda_backend,
                                     resolve_backend, same_device, sync_threads)
from cb_kernels.ops._varlen import check_values, check_varlen, rows_arg

_BACKENDS = ("triton", "cpu", "torch")


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                   cu_seqlens: torch.Tensor, has_state: torch.Tensor, *,
                   D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = True, dt_limit: tuple = (0.0, float("inf")),
                   backend: str | None = None, isa: str = "auto") -> torch.Tensor:
    """Per row, head h (group ``h // (num_heads // num_groups)``) and token:
    ``dt' = clamp(softplus(dt + dt_bias))``, ``S = S * exp(dt' A[h]) + dt' x B^T``,
    ``out = S C + D[h] x`` (csrc/include/cb_kernels/selective_scan.h), S from the slot when
    has_state, else zeros; the final S back into the slot.

    Parameters
    ----------
    x : ``[num_tokens, num_heads, head_dim]`` float32 or bfloat16; heads and head_dim packed,
        tokens any stride.
    dt : float32 ``[num_tokens, num_heads]``, contiguous (before dt_bias and softplus).
    A : float32 ``[num_heads]`` (Mamba-2: ``-exp(A_log)``).
    B, C : ``[num_tokens, num_groups, d_state]`` of x's dtype; groups and d_state packed, tokens
        any stride; num_heads a multiple of num_groups.
    state : float32 ``[num_slots, num_heads, head_dim, d_state]``, contiguous, updated in place.
    slots, cu_seqlens, has_state : as ops.gated_delta_rule's.
    D, dt_bias : float32 ``[num_heads]`` or None.
    dt_limit : (lo, hi) clamp of dt' (transformers' time_step_limit; (0, inf): none).
    backend : None (cpu for CPU tensors, triton for CUDA), "cpu", "triton" or "torch".
    isa : caps the CPU body (tests).

    Returns ``[num_tokens, num_heads, head_dim]`` in x's dtype.
    """
    _check(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D, dt_bias)
    check_values(state, slots, cu_seqlens, x.shape[0])
    chosen = resolve_backend(backend, x.device, _BACKENDS, default_cuda_backend(_BACKENDS),
                             "selective_scan")
    if chosen == "torch":
        from cb_kernels.ops.reference import ref_selective_scan

        return ref_selective_scan(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D=D,
                                  dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    out = torch.empty((x.shape[0], x.shape[1], x.shape[2]), dtype=x.dtype, device=x.device)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if hi == float("inf") and lo == 0.0:
        lo = hi = 0.0                                     # no clamp
    if chosen == "triton":
        from cb_kernels.triton.selective_scan import selective_scan_triton

        selective_scan_triton(x, dt, A, B, C, state, slots, cu_seqlens, has_state, out, D,
                              dt_bias, bool(dt_softplus), lo, hi)
        return out
    sync_threads()
    _C.selective_scan(
        x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
        0 if D is None else D.data_ptr(), 0 if dt_bias is None else dt_bias.data_ptr(),
        state.data_ptr(), out.data_ptr(), rows_arg(slots, cu_seqlens, has_state, state.shape[0]),
        x.shape[1], x.shape[2],
        B.shape[1], B.shape[2], x.stride(0), B.stride(0), C.stride(0), bool(dt_softplus),
        lo, hi, isa, DTYPE_CODES[x.dtype])
    return out


def _check(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D, dt_bias) -> None:
    check_tensor(x, "x", ndim=3)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"x's heads and head_dim must be packed, got strides {x.stride()}")
    for name, t in (("B", B), ("C", C)):
        check_tensor(t, name, ndim=3, dtype=x.dtype)
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}'s groups and d_state must be packed, got strides "
                             f"{t.stride()}")
    if tuple(C.shape) != tuple(B.shape) or B.shape[0] != num_tokens or B.shape[1] == 0 \
            or num_heads % B.shape[1]:
        raise ValueError(f"B and C must be [num_tokens={num_tokens}, num_groups, d_state] with "
                         f"num_heads={num_heads} a multiple of num_groups, got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    check_tensor(dt, "dt", ndim=2, dtype=torch.float32, contiguous=True)
    if tuple(dt.shape) != (num_tokens, num_heads):
        raise ValueError(f"dt must have shape {(num_tokens, num_heads)}, got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is None and name != "A":
            continue
        check_tensor(t, name, ndim=1, dtype=torch.float32, contiguous=True)
        if t.shape[0] != num_heads:
            raise ValueError(f"{name} must have shape [{num_heads}], got {tuple(t.shape)}")
    check_tensor(state, "state", ndim=4, dtype=torch.float32, contiguous=True)
    if tuple(state.shape[1:]) != (num_heads, head_dim, B.shape[2]):
        raise ValueError(f"state must have shape [num_slots, {num_heads}, {head_dim}, "
                         f"{B.shape[2]}], got {tuple(state.shape)}")
    check_varlen(slots, cu_seqlens, has_state)
    same_device([("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("state", state),
                 ("slots", slots), ("cu_seqlens", cu_seqlens), ("has_state", has_state)]
                + [(name, t) for name, t in (("D", D), ("dt_bias", dt_bias)) if t is not None])


@torch.library.custom_op("cb_kernels::selective_scan", mutates_args=("state",))
def _selective_scan_op(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       cu_seqlens: torch.Tensor, has_state: torch.Tensor,
                       D: torch.Tensor | None, dt_bias: torch.Tensor | None) -> torch.Tensor:
    return selective_scan(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D=D,
                          dt_bias=dt_bias)


@_selective_scan_op.register_fake
def _(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D, dt_bias) -> torch.Tensor:
    _check(x, dt, A, B, C, state, slots, cu_seqlens, has_state, D, dt_bias)
    return x.new_empty(x.shape)
