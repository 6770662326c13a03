"""`rms_norm`: RMSNorm of float32 or bfloat16 CPU rows, with an optional residual added into x
first, in one pass (csrc/cpu/elementwise.cpp says why and what it measured). The engine's
Llama-family forward uses it; results match torch's ops to fp32 rounding. In bf16 the math is
fp32 with transformers' roundings: x = bf16(x + residual), out = bf16(weight * bf16(x * inv_rms)),
as LlamaRMSNorm after a bf16 residual add (ops/reference.py ref_rms_norm). Rows may be strided;
elements within a row must be packed.
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops._rows import as_rows, row_stride


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, *, isa: str = "auto") -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2, -1) + eps)``, after ``x += residual`` in place if given.

    Parameters
    ----------
    x : float32 or bfloat16 CPU ``[..., dim]``, rows any stride, dim packed; updated in place
        when a residual is given.
    weight : CPU ``[dim]``, x's dtype.
    eps : added to the mean square.
    residual : CPU tensor with x's rows, dim and dtype, or None.
    isa : caps the kernel's body ("auto" or one of ``_C.cpu_isas()``, for tests).

    Returns a new tensor shaped like x, of x's dtype.
    """
    rx, w, rr = _check(x, weight, residual)
    if torch.compiler.is_compiling():   # traced: the registered op (x marked as mutated)
        return torch.ops.cb_kernels.rms_norm(x, weight, float(eps), residual)
    return _run(x, rx, w, rr, eps, isa)


def _check(x, weight, residual):
    rx = as_rows("x", x)
    dim = rx.shape[1]
    w = as_rows("weight", weight, dim, x.dtype)
    if w.shape[0] != 1:
        raise ValueError(f"weight must be [{dim}], got shape {tuple(weight.shape)}")
    rr = None
    if residual is not None:
        rr = as_rows("residual", residual, dim, x.dtype)
        if rr.shape[0] != rx.shape[0]:
            raise ValueError(f"residual has {rr.shape[0]} rows, x has {rx.shape[0]}")
    return rx, w, rr


def _run(x, rx, w, rr, eps, isa: str = "auto") -> torch.Tensor:
    dim = rx.shape[1]
    out = torch.empty(rx.shape, dtype=x.dtype)
    sync_threads()
    _C.rms_norm(rx.data_ptr(), 0 if rr is None else rr.data_ptr(), w.data_ptr(), out.data_ptr(),
                rx.shape[0], dim, row_stride(rx), 0 if rr is None else row_stride(rr), dim, float(eps),
                isa, DTYPE_CODES[x.dtype])
    return out.view(x.shape)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine's hot path: `rms_norm` without the checks (a few us a call, ~60 calls a step).

    Parameters
    ----------
    x : contiguous float32 or bfloat16 CPU ``[rows, dim]``; ``x += residual`` in place first.
    weight : contiguous CPU ``[dim]``, x's dtype.
    eps : added to the mean square.
    residual : contiguous CPU ``[rows, dim]`` of x's dtype, or None.

    The caller vouches for shapes, dtypes and contiguity. Returns a new ``[rows, dim]`` tensor.
    """
    rows, dim = x.shape
    out = torch.empty_like(x)
    _C.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                out.data_ptr(), rows, dim, dim, dim, dim, float(eps), "auto",
                DTYPE_CODES[x.dtype])
    return out


# The torch.library op, so torch.compile can trace the call. Eager calls skip it: the custom-op
# dispatch layers cost more than the kernel (see ops/paged_attention/__init__.py for the measurement).
@torch.library.custom_op("cb_kernels::rms_norm", mutates_args=("x",))
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    rx, w, rr = _check(x, weight, residual)
    return _run(x, rx, w, rr, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps, residual=None) -> torch.Tensor:
    _check(x, weight, residual)
    return torch.empty(x.shape, dtype=x.dtype)
