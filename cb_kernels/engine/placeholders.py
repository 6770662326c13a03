"""Placeholders of an overlapped step: the input ids of step N+1 that step N's tokens fill on the
device (engine/step_loop.py says when a sequence holds one)."""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels.engine.scheduler import ScheduledBatch
from cb_kernels.engine.sequence import PLACEHOLDER
from cb_kernels.engine.step import LaunchedStep


def placeholder_rows(batch: ScheduledBatch, prev: Optional[LaunchedStep], block_size: int):
    """Where `batch` feeds a placeholder: (dst, src, fills) with dst the indices into its packed
    input_ids [num_tokens], src the rows of prev.device_tokens that hold those tokens, and fills
    the (seq, num_new_tokens) of the rows among them that fill a block, whose hash waits for the
    token (BlockManager.commit). Call before the batch is advanced (num_computed_tokens as
    scheduled)."""
    dst, src, fills, row_of, end = [], [], [], None, 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        end += n
        tokens = seq.token_ids
        if tokens[-1] == PLACEHOLDER and seq.num_computed_tokens + n == len(tokens):
            if row_of is None:
                assert prev is not None and prev.device_tokens is not None, \
                    f"{seq} holds a placeholder but no step is in flight"
                row_of = {s.seq_id: i for i, s in enumerate(prev.sampled)}
            dst.append(end - 1)
            src.append(row_of[seq.seq_id])
            if len(tokens) % block_size == 0:
                fills.append((seq, n))
    return dst, src, fills


def _is_range(idx: list) -> bool:
    return idx == list(range(idx[0], idx[0] + len(idx)))


def fill_placeholders(input_ids: torch.Tensor, dst: list, src: list, prev_tokens: torch.Tensor,
                      to_device) -> None:
    """input_ids[dst] = prev_tokens[src] on the device, in stream order (no host sync).

    input_ids: int64 [num_tokens]; prev_tokens: int64 [num_prev_sampled], both on one device;
    to_device moves a host index tensor there (StreamOrchestrator.to_device). In steady decoding
    both index lists are ranges (the running requests keep their order), which needs no upload.
    """
    if not dst:
        return
    if _is_range(dst) and _is_range(src):
        k = len(dst)
        input_ids[dst[0]:dst[0] + k].copy_(prev_tokens[src[0]:src[0] + k])
        return
    idx = to_device(torch.tensor([dst, src], dtype=torch.int64))
    input_ids.index_copy_(0, idx[0], prev_tokens.index_select(0, idx[1]))
