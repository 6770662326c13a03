"""`offset_rms_norm`: the RMSNorm scaled by (1 + weight), Qwen3-Next's Qwen3NextRMSNorm, with an
optional residual added into x first, in one pass (csrc/cpu/offset_rms_norm.cpp says why and what
it measured). transformers computes ``(x.float() * rsqrt(mean(x.float()**2) + eps) * (1.0 +
weight.float())).type_as(x)`` after ``x = residual + h`` in x's dtype; so does this op, with the
sum of squares in another order (fp32 rounding; ops/reference.py ref_offset_rms_norm is the
torch formula). CPU, float32 or bfloat16; rows may be strided, elements within a row packed.
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops._rows import as_rows, row_stride


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None, *, isa: str = "auto") -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * (1 + weight)`` in fp32, rounded once to x's dtype,
    after ``x += residual`` in place (rounded to x's dtype) if given.

    Parameters
    ----------
    x : float32 or bfloat16 CPU ``[..., dim]``, rows any stride, dim packed; updated in place
        when a residual is given.
    weight : contiguous CPU ``[dim]`` of x's dtype (the module's own weight, not 1 + weight).
    eps : added to the mean square.
    residual : CPU tensor with x's rows, dim and dtype (rows any stride), or None.
    isa : caps the CPU body ("auto", or one of ``_C.cpu_isas()``, for tests): "avx512" or
        "portable" run.

    Returns a new contiguous tensor shaped like x, of x's dtype.
    """
    rx = as_rows("x", x)
    dim = rx.shape[1]
    if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or \
            weight.device.type != "cpu" or weight.dim() != 1 or not weight.is_contiguous():
        raise TypeError(f"weight must be a contiguous 1-D CPU tensor of x's dtype {x.dtype}")
    if weight.shape[0] != dim:
        raise ValueError(f"weight must be [{dim}], got shape {tuple(weight.shape)}")
    rr = None
    if residual is not None:
        rr = as_rows("residual", residual, dim, x.dtype)
        if rr.shape[0] != rx.shape[0]:
            raise ValueError(f"residual has {rr.shape[0]} rows, x has {rx.shape[0]}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if torch.compiler.is_compiling():   # traced: the registered op (x marked as mutated)
        return torch.ops.cb_kernels.offset_rms_norm(x, weight, float(eps), residual)
    out = torch.empty(rx.shape, dtype=x.dtype)
    _run(rx, weight, eps, rr, out, isa)
    return out.view(x.shape)


def _run(rx, weight, eps, rr, out, isa: str = "auto") -> torch.Tensor:
    sync_threads()
    _C.offset_rms_norm(rx.data_ptr(), 0 if rr is None else rr.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), rx.shape[0], rx.shape[1], row_stride(rx),
                       0 if rr is None else row_stride(rr), float(eps), isa,
                       DTYPE_CODES[rx.dtype])
    return out


def offset_rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float,
                              residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine's hot path (runner/hybrid_layers.py): no checks. x ``[rows, dim]`` with a
    unit last stride (rows any stride; ``x += residual`` in place first), weight contiguous
    ``[dim]``, residual ``[rows, dim]`` with a unit last stride or None, all of x's dtype.
    Returns a new contiguous ``[rows, dim]`` tensor."""
    return _run(x, weight, eps, residual, torch.empty(x.shape, dtype=x.dtype))


# The torch.library op, so torch.compile can trace the call (eager calls skip it, as rms_norm's).
@torch.library.custom_op("cb_kernels::offset_rms_norm", mutates_args=("x",))
def _offset_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return offset_rms_norm(x, weight, eps, residual)


@_offset_rms_norm_op.register_fake
def _(x, weight, eps, residual=None) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype)
