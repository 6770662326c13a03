"""Inputs of the Triton/CUDA paged-attention tests: an id-labelled case and its tensors."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Tolerance next to each dtype: outputs are convex mixes of N(0, 1) values (|out| < ~3).
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Case:
    id: str
    q_lens: tuple
    seq_lens: tuple
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    window: int | None = None
    softcap: float | None = None
    interleaved: bool = False  # K and V as strided views of one [blocks, bs, 2, kvh, D] buffer


def make_inputs(c: Case, device="cpu", seed=0, spare_blocks=3):
    """Random q and a NaN-filled pool where only the slots below each seq_len hold data, reached
    through a shuffled block table whose unused entries point far outside the pool."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(c.q_lens)
    max_blocks = max(1, max(math.ceil(n / c.block_size) for n in c.seq_lens))
    num_blocks = num_seqs * max_blocks + spare_blocks
    shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    if c.interleaved:
        kv = torch.full((num_blocks, c.block_size, 2, c.num_kv_heads, c.head_dim), float("nan"),
                        dtype=c.dtype)
        k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    else:
        k_cache = torch.full(shape, float("nan"), dtype=c.dtype)
        v_cache = torch.full(shape, float("nan"), dtype=c.dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((num_seqs, max_blocks), 1 << 30, dtype=torch.int32)
    for s, n in enumerate(c.seq_lens):
        for j in range(math.ceil(n / c.block_size)):
            b = perm.pop()
            block_tables[s, j] = b
            rows = (min(c.block_size, n - j * c.block_size), c.num_kv_heads, c.head_dim)
            k_cache[b, :rows[0]] = torch.randn(rows, generator=g).to(c.dtype)
            v_cache[b, :rows[0]] = torch.randn(rows, generator=g).to(c.dtype)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(c.q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), c.num_heads, c.head_dim, generator=g).to(c.dtype)
    seq_lens = torch.tensor(c.seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens, cu)]
