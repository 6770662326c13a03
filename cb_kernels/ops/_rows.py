"""Row views of the fused CPU passes' tensors (rms_norm, silu_mul; float32 or bfloat16): [..., dim]
as [rows, dim] with strided rows and packed elements, checked; errors name the argument."""
from __future__ import annotations

from typing import Optional

import torch


DTYPES = (torch.float32, torch.bfloat16)


def as_rows(name: str, t, dim: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t as [rows, dim] (a view) with a unit last stride; checks a float32 or bfloat16 CPU
    tensor, of `dtype` when given (the call's other tensors)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        raise TypeError(f"{name} must be a float32 or bfloat16 CPU tensor, got {t.dtype} on "
                        f"{t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have the input's dtype {dtype}, got {t.dtype}")
    if t.dim() < 1 or (dim is not None and t.shape[-1] != dim):
        raise ValueError(f"{name} must end in {dim if dim is not None else 'a feature dim'}, got "
                         f"shape {tuple(t.shape)}")
    if t.dim() == 1:
        t = t[None]
    try:
        r = t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} must be viewable as [rows, {t.shape[-1]}] (strides "
                         f"{t.stride()})") from None
    if r.shape[-1] > 1 and r.stride(-1) != 1:
        raise ValueError(f"{name} must be packed along its last dim (strides {t.stride()})")
    return r


def row_stride(r: torch.Tensor) -> int:
    return r.stride(0) if r.shape[0] > 1 else r.shape[1]
