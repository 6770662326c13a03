"""`gated_rms_norm`: the gated RMSNorm after a stateful layer's scan, one pass over the rows
(csrc/cpu/gated_rms_norm.cpp says why). Two forms, as transformers writes them:

- ``norm_before_gate=True``: Qwen3-Next / Qwen3.5's RMSNormGated, per group (value head):
  ``out = bf16(bf16(weight * bf16(x * r(x))) * silu(gate))``;
- ``norm_before_gate=False``: the Mamba-2 mixers' MambaRMSNormGated:
  ``h = x * silu(gate)``, ``out = bf16(weight * bf16(h * r(h)))``,

with ``r(v) = 1 / sqrt(mean(v**2 over the group) + eps)`` in fp32 (the bf16 roundings are
identities in fp32). Results agree with transformers' op chain to fp32 rounding (another
summation order), not bit for bit. CPU, float32 or bfloat16.
"""
from __future__ import annotations

import functools

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops._rows import as_rows, row_stride


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   group_size: int, norm_before_gate: bool = True,
                   isa: str = "auto") -> torch.Tensor:
    """The gated RMSNorm of every ``group_size`` elements of each row of x.

    Parameters
    ----------
    x : float32 or bfloat16 CPU ``[..., dim]``, dim a multiple of group_size; rows any stride,
        elements packed.
    gate : ``[..., dim]`` with x's rows and dtype (the layer's z), rows any stride.
    weight : ``[group_size]`` (one weight for every group: Qwen3-Next's per-head norm) or
        ``[dim]`` (Mamba-2's), x's dtype, contiguous.
    eps : added to the mean square.
    group_size : elements normalised together (Qwen3-Next: head_v_dim; Mamba-2:
        intermediate_size // n_groups).
    norm_before_gate : True: Qwen3-Next's order; False: Mamba-2's (gate first).
    isa : caps the CPU body ("auto", or one of ``_C.cpu_isas()``, for tests): "avx512" or
        "portable" run (``_C.gated_delta_rule_isa`` names the one chosen, the same two bodies).

    Returns a new contiguous tensor shaped like x, of x's dtype.
    """
    rx = as_rows("x", x)
    dim = rx.shape[1]
    rg = as_rows("gate", gate, dim, x.dtype)
    if rg.shape[0] != rx.shape[0]:
        raise ValueError(f"gate has {rg.shape[0]} rows, x has {rx.shape[0]}")
    if not isinstance(group_size, int) or group_size <= 0 or dim % group_size:
        raise ValueError(f"group_size must be a positive divisor of x's last dim {dim}, got "
                         f"{group_size!r}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or \
            weight.device.type != "cpu" or weight.dim() != 1 or not weight.is_contiguous():
        raise TypeError(f"weight must be a contiguous 1-D CPU tensor of x's dtype {x.dtype}")
    if weight.shape[0] not in (group_size, dim):
        raise ValueError(f"weight must be [group_size={group_size}] or [dim={dim}], got "
                         f"{tuple(weight.shape)}")
    out = torch.empty(rx.shape, dtype=x.dtype)
    gated_rms_norm_unchecked(rx, rg, weight, eps, out, group_size, bool(norm_before_gate),
                             gate_token_stride=row_stride(rg), x_stride=row_stride(rx), isa=isa)
    return out.view(x.shape)


@functools.lru_cache(maxsize=None)
def gated_rms_norm_fast() -> bool:
    """Whether the AVX-512 body runs on this CPU: 13.6 us against transformers' 46 us for 16
    rows x 4 heads x 128 (bf16, 1 thread, Zen 4); the portable body took 84 us, so callers
    keep transformers' norm without it."""
    return _C.gated_delta_rule_isa("auto") == "avx512"


def gated_rms_norm_unchecked(x, gate, weight, eps: float, out, group_size: int,
                             norm_before_gate: bool, *, gate_token_stride: int,
                             gate_block_stride: int = 0, groups_per_block: int | None = None,
                             x_stride: int | None = None, isa: str = "auto") -> torch.Tensor:
    """The engine's hot path (runner/hybrid_kernels.py): no checks. x ``[tokens, dim]`` (rows
    x_stride apart, default dim), out contiguous ``[tokens, dim]``. Group j of token t reads its
    gate at ``gate + t * gate_token_stride + (j // groups_per_block) * gate_block_stride +
    (j % groups_per_block) * group_size``: Qwen3-Next's z where the fused qkvz projection left
    it (groups_per_block value heads per key head, gate_block_stride elements apart); None: the
    groups packed in one block (a plain [tokens, dim] gate)."""
    tokens, dim = out.shape
    sync_threads()
    _C.gated_rms_norm(x.data_ptr(), gate.data_ptr(), weight.data_ptr(), out.data_ptr(), tokens,
                      dim // group_size, group_size, weight.shape[0],
                      dim if x_stride is None else x_stride, gate_token_stride,
                      gate_block_stride,
                      dim // group_size if groups_per_block is None else groups_per_block, float(eps), norm_before_gate,
                      isa, DTYPE_CODES[out.dtype])
    return out


@torch.library.custom_op("cb_kernels::gated_rms_norm", mutates_args=())
def _gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       group_size: int, norm_before_gate: bool) -> torch.Tensor:
    return gated_rms_norm(x, gate, weight, eps, group_size=group_size,
                          norm_before_gate=norm_before_gate)


@_gated_rms_norm_op.register_fake
def _(x, gate, weight, eps, group_size, norm_before_gate) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype)
