"""`greedy_tokens`: the greedy token of each row of logits, torch.argmax's result, faster on CPU.

The engine calls this on every all-greedy step (csrc/cpu/greedy_tokens.cpp says why and what it
measured). fp32 CPU logits go to the kernel (binding `_C.greedy_tokens`); anything else (GPU,
other dtypes, logits that require grad) to torch.argmax, which is also the reference
(`ref_greedy_tokens`).
"""
from __future__ import annotations

import torch

from cb_kernels import _C


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value (a NaN counts as largest), as
    ``logits.argmax(-1)``.

    Parameters
    ----------
    logits : ``[num_rows, vocab_size]``, any float dtype, device and strides; vocab_size >= 1.

    Returns int64 ``[num_rows]`` on logits' device.
    """
    _check(logits)
    if torch.compiler.is_compiling():   # traced: the registered op
        return torch.ops.cb_kernels.greedy_tokens(logits)
    return _run(logits)


def _check(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column (vocab_size >= 1)")


def _run(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(dim=-1)
    if logits.stride(1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
        logits = logits.contiguous()      # columns apart, or rows that overlap (expand)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _C.greedy_tokens(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                   logits.stride(0) if logits.shape[0] > 1 else logits.shape[1])
    return out


@torch.library.custom_op("cb_kernels::greedy_tokens", mutates_args=())
def _greedy_tokens_op(logits: torch.Tensor) -> torch.Tensor:
    _check(logits)
    return _run(logits)


@_greedy_tokens_op.register_fake
def _(logits) -> torch.Tensor:
    _check(logits)
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
