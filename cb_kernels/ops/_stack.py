"""What the one-call backbones (ops.Mamba2Stack, ops.Qwen3NextStack) share: the checks of their
embedding and layer list and of a step's token ids and sampled rows."""
from __future__ import annotations

import torch

from cb_kernels.ops._backend import check_tensor


def check_embed_and_layers(embed, layers, kinds: str) -> None:
    """embed: a contiguous float32 / bfloat16 CPU ``[vocab, hidden]``; layers: a non-empty list
    (of `kinds`, named in the error)."""
    check_tensor(embed, "embed", ndim=2, contiguous=True)
    if embed.dtype not in (torch.float32, torch.bfloat16) or embed.device.type != "cpu":
        raise TypeError(f"embed must be a float32 or bfloat16 CPU tensor, got {embed.dtype} "
                        f"on {embed.device}")
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"layers must be a non-empty list of {kinds}")


def check_ids(input_ids, logits_indices, vocab: int) -> int:
    """input_ids int64 ``[num_tokens]`` in ``[0, vocab)``, logits_indices int64
    ``[num_sampled]`` in ``[0, num_tokens)``; returns num_tokens."""
    for name, t in (("input_ids", input_ids), ("logits_indices", logits_indices)):
        check_tensor(t, name, ndim=1, dtype=torch.int64, contiguous=True)
    n = input_ids.shape[0]
    if n and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (embed's vocab)")
    if logits_indices.numel() and not (
            0 <= int(logits_indices.min()) and int(logits_indices.max()) < n):
        raise ValueError(f"logits_indices must lie in [0, {n}) (num_tokens)")
    return n

