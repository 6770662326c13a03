"""`rope_`: the rotary embedding of float32 or bfloat16 CPU q or k heads, in place, in one pass
(csrc/cpu/elementwise.cpp says why and what it measured); matches transformers'
apply_rotary_pos_emb to fp32 rounding (bf16: each product and the sum rounded, as its bf16 ops).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """``x = x * cos + rotate_half(x) * sin`` in place, as transformers' apply_rotary_pos_emb.

    Parameters
    ----------
    x : float32 or bfloat16 CPU ``[num_tokens, num_heads, head_dim]``, head_dim even and packed;
        tokens and heads any stride (a view into a fused qkv output works). Rotated in place.
    cos, sin : contiguous CPU ``[num_tokens, head_dim]`` of x's dtype.
    isa : caps the kernel's body ("auto" or one of ``_C.cpu_isas()``, for tests).

    Returns x.
    """
    _check(x, cos, sin)
    if torch.compiler.is_compiling():   # traced: the registered op (x marked as mutated)
        torch.ops.cb_kernels.rope_(x, cos, sin)
    else:
        _run(x, cos, sin, isa)
    return x


def _check(x, cos, sin) -> None:
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" \
                or t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be a float32 or bfloat16 CPU tensor")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, num_heads, even head_dim] with head_dim packed, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    want = (x.shape[0], x.shape[2])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {list(want)}, got shape {tuple(t.shape)}")


def _run(x, cos, sin, isa: str = "auto") -> None:
    sync_threads()
    _C.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
            x.stride(0), x.stride(1), isa, DTYPE_CODES[x.dtype])


@torch.library.custom_op("cb_kernels::rope_", mutates_args=("x",))
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    _check(x, cos, sin)
    _run(x, cos, sin)


@_rope_op.register_fake
def _(x, cos, sin) -> None:
    _check(x, cos, sin)
