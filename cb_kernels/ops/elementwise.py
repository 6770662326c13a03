"""Fused fp32 decoder-layer operations on CPU (csrc/cpu/elementwise.cpp says why): RMSNorm with
an optional residual add, SiLU(gate) * up, and the rotary embedding in place. The engine's
Llama-family forward (cb_kernels/hf/fast_llama.py) uses them; results match torch's ops to fp32
rounding. Rows may be strided; elements within a row must be packed.
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import sync_threads


def _rows(name: str, t, dim: Optional[int] = None) -> torch.Tensor:
    """t as [rows, dim] (a view) with a unit last stride; checks fp32 CPU."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
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


def _stride(r: torch.Tensor) -> int:
    return r.stride(0) if r.shape[0] > 1 else r.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [..., dim]; weight: [dim]; residual: like x or None. With a residual, x += residual in
    place first. Returns a new tensor like x: weight * x / sqrt(mean(x^2, -1) + eps)."""
    rx = _rows("x", x)
    dim = rx.shape[1]
    w = _rows("weight", weight, dim)
    if w.shape[0] != 1:
        raise ValueError(f"weight must be [{dim}], got shape {tuple(weight.shape)}")
    rr = None
    if residual is not None:
        rr = _rows("residual", residual, dim)
        if rr.shape[0] != rx.shape[0]:
            raise ValueError(f"residual has {rr.shape[0]} rows, x has {rx.shape[0]}")
    out = torch.empty(rx.shape, dtype=torch.float32)
    sync_threads()
    _C.rms_norm(rx.data_ptr(), 0 if rr is None else rr.data_ptr(), w.data_ptr(), out.data_ptr(),
                rx.shape[0], dim, _stride(rx), 0 if rr is None else _stride(rr), dim, float(eps))
    return out.view(x.shape)


def rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine's hot path: `rms_norm` on contiguous fp32 CPU x [rows, dim] (residual the same
    or None, weight [dim]) without the checks (a few us a call, ~60 calls a step). The caller
    vouches for shapes, dtypes and contiguity. x += residual in place first; returns the norm."""
    rows, dim = x.shape
    out = torch.empty_like(x)
    _C.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                out.data_ptr(), rows, dim, dim, dim, dim, float(eps))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * dim] (gate then up). Returns [..., dim] = silu(gate) * up."""
    r = _rows("gate_up", gate_up)
    if r.shape[1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {r.shape[1]}")
    dim = r.shape[1] // 2
    out = torch.empty((r.shape[0], dim), dtype=torch.float32)
    sync_threads()
    _C.silu_mul(r.data_ptr(), out.data_ptr(), r.shape[0], dim, _stride(r), dim)
    return out.view(*gate_up.shape[:-1], dim)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim], head_dim packed, rotated in place and returned;
    cos, sin: [tokens, head_dim] packed. x = x * cos + rotate_half(x) * sin, as transformers'
    apply_rotary_pos_emb."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 CPU tensor")
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, heads, even head_dim] with head_dim packed, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    want = (x.shape[0], x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {list(want)}, got shape {tuple(t.shape)}")
    sync_threads()
    _C.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
            x.stride(0), x.stride(1))
    return x
