"""`sample_tokens`: one token drawn per row of logits and its logprob, in one pass per row.

The sampler (engine/sampler.py) draws every sampled token through this op, whichever path the
row took (its top-k candidates or the whole vocabulary), so a row's token never depends on the
path. Per row, with ``y = (logits - max) / temperature``: the inverse-CDF draw with the row's
uniform over the masses ``exp(y)``, the token's logprob ``y[token] - logsumexp(y)`` and the
logsumexp. fp32 CPU logits go to the kernel (csrc/cpu/sample_tokens.cpp: exact integer masses,
so the token does not depend on the order of additions or the threads); anything else to the
torch reference `ref_sample_tokens` (fp32 cumsum and searchsorted: the same token except when
the target falls within rounding of a column boundary, the same logprob to fp32 rounding).
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import sync_threads
from cb_kernels.ops.reference import ref_sample_tokens

MAX_COLS = 1 << 22      # the kernel's integer sums stay below 2^62


def sample_tokens(logits: torch.Tensor, u: torch.Tensor,
                  temperature: Optional[torch.Tensor] = None, *, isa: str = "auto") -> tuple:
    """One token per row of logits.

    Parameters
    ----------
    logits : float ``[num_rows, num_cols]`` (any device; fp32 CPU runs the kernel), num_cols in
        [1, 2^22]. A row may hold -inf (masked columns) but not only -inf.
    u : fp32 ``[num_rows]`` uniforms in (0, 1), logits' device (sampler.uniforms).
    temperature : fp32 ``[num_rows]`` > 0, or None for 1 in every row.
    isa : caps the CPU body ("auto", or one of ``_C.cpu_isas()``, for tests): "avx512" or
        "portable" (they give the same bits).

    Returns ``(tokens, logprobs, lse)``: int64 ``[num_rows]`` the drawn column of each row; fp32
    ``[num_rows]`` its logprob ``y[token] - lse``; fp32 ``[num_rows]`` ``logsumexp(y)``. A row
    holding NaN or +inf gives its first NaN (else first +inf) and NaN logprob and lse.
    """
    _check(logits, u, temperature)
    return sample_tokens_unchecked(logits, u, temperature, isa=isa)


def _check(logits, u, temperature) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, num_cols], got shape "
                         f"{tuple(logits.shape)}")
    if not 1 <= logits.shape[1] <= MAX_COLS:
        raise ValueError(f"logits must have 1 to 2^22 columns, got {logits.shape[1]}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    for name, t in (("u", u), ("temperature", temperature)):
        if t is None and name == "temperature":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be an fp32 torch.Tensor")
        if tuple(t.shape) != (logits.shape[0],) or t.device != logits.device:
            raise ValueError(f"{name} must be [num_rows={logits.shape[0]}] on {logits.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if u.numel() and not bool(((u > 0) & (u < 1)).all()):
        raise ValueError("u must hold uniforms in (0, 1)")
    if temperature is not None and temperature.numel() and not bool((temperature > 0).all()):
        raise ValueError("temperature must be > 0 in every row")


def sample_tokens_unchecked(logits: torch.Tensor, u: torch.Tensor,
                            temperature: Optional[torch.Tensor] = None, *,
                            isa: str = "auto") -> tuple:
    """The sampler's hot path: sample_tokens without the checks (the caller made u and the
    temperatures; logits are the step's rows)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return ref_sample_tokens(logits.float(), u, temperature)
    if logits.stride(1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
        logits = logits.contiguous()      # columns apart, or rows that overlap (expand)
    rows = logits.shape[0]
    u = u.contiguous()
    if temperature is not None:
        temperature = temperature.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs, lse = torch.empty(rows), torch.empty(rows)
    sync_threads()
    _C.sample_tokens(logits.data_ptr(), temperature.data_ptr() if temperature is not None else 0,
                     u.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), lse.data_ptr(), rows,
                     logits.shape[1], logits.stride(0) if rows > 1 else logits.shape[1], isa)
    return tokens, logprobs, lse


@torch.library.custom_op("cb_kernels::sample_tokens", mutates_args=())
def _sample_tokens_op(logits: torch.Tensor, u: torch.Tensor,
                      temperature: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    _check(logits, u, temperature)
    return sample_tokens_unchecked(logits, u, temperature)


@_sample_tokens_op.register_fake
def _(logits, u, temperature):
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32),
            logits.new_empty(rows, dtype=torch.float32))
