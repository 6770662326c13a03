"""Greedy token choice over logits: `greedy_tokens`, torch.argmax's result, faster on CPU.

The engine calls this on every all-greedy step (csrc/cpu/sampling.cpp says why and what it
measured). fp32 CPU logits go to the kernel; anything else (GPU, other dtypes) to torch.argmax,
which is the reference.
"""
from __future__ import annotations

import torch

from cb_kernels import _C


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits: [num_rows, vocab_size], any float dtype and device. Returns int64 [num_rows]: the
    first index of each row's largest value (a NaN counts as largest), as torch.argmax(-1)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column (vocab_size >= 1)")
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(dim=-1)
    if logits.stride(1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
        logits = logits.contiguous()      # columns apart, or rows that overlap (expand)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _C.argmax_rows(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                   logits.stride(0) if logits.shape[0] > 1 else logits.shape[1])
    return out
