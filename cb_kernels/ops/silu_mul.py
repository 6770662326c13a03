"""`silu_mul`: SiLU(gate) * up of float32 or bfloat16 CPU rows in one pass (csrc/cpu/elementwise.cpp
says why and what it measured); matches torch's ops to fp32 rounding (bf16: bf16(bf16(silu(g)) *
up), as torch's two bf16 ops). Rows may be strided; elements within a row must be packed.
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops._rows import as_rows, row_stride


def silu_mul(gate_up: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection.

    Parameters
    ----------
    gate_up : float32 or bfloat16 CPU ``[..., 2 * dim]``, gate in the first half of the last
        dim, up in the second; rows any stride, the last dim packed.
    isa : caps the kernel's body ("auto" or one of ``_C.cpu_isas()``, for tests).

    Returns a new ``[..., dim]`` tensor of gate_up's dtype.
    """
    r = _check(gate_up)
    if torch.compiler.is_compiling():   # traced: the registered op
        return torch.ops.cb_kernels.silu_mul(gate_up)
    return _run(gate_up, r, isa)


def _check(gate_up) -> torch.Tensor:
    r = as_rows("gate_up", gate_up)
    if r.shape[1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {r.shape[1]}")
    return r


def _run(gate_up, r, isa: str = "auto") -> torch.Tensor:
    dim = r.shape[1] // 2
    out = torch.empty((r.shape[0], dim), dtype=r.dtype)
    sync_threads()
    _C.silu_mul(r.data_ptr(), out.data_ptr(), r.shape[0], dim, row_stride(r), dim, isa,
                DTYPE_CODES[r.dtype])
    return out.view(*gate_up.shape[:-1], dim)


@torch.library.custom_op("cb_kernels::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _run(gate_up, _check(gate_up))


@_silu_mul_op.register_fake
def _(gate_up) -> torch.Tensor:
    _check(gate_up)
    return torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype)
