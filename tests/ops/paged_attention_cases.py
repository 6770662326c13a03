"""Cases and input builder for tests/ops/test_paged_attention.py.

Inputs are built to make wrong reads fail loudly: every cache slot a sequence does not own is NaN,
block tables are shuffled, non-contiguous column slices whose unused entries point at a NaN block.
"""
from __future__ import annotations

import dataclasses
import math

import torch

# Tolerances next to the dtype: (atol, rtol) against the fp32 reference rounded to the dtype.
# fp16/bf16 outputs may differ by one unit in the last place of a value near 1.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    seqs: tuple[tuple[int, int], ...]  # (seq_len, q_len) of each sequence
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    interleaved: bool = False  # K/V as views of one [num_blocks, 2, ...] buffer, as transformers
    interpreter: bool = False  # small enough for the Triton interpreter (< ~5 s)


MIXED = ((1, 1), (17, 1), (63, 1), (1030, 1), (40, 40), (300, 37))  # decodes, prefill, chunk
CASES = [
    Case("decode-len1", ((1, 1),), interpreter=True),
    Case("mixed-gqa4-d64-bs16", MIXED, interpreter=True),
    Case("mixed-gqa1-d80-bs8", MIXED, num_heads=4, num_kv_heads=4, head_dim=80, block_size=8),
    Case("mixed-gqa8-d128-bs32", MIXED, num_heads=16, num_kv_heads=2, head_dim=128,
         block_size=32, interleaved=True),
    Case("mixed-gqa3-d96-bs64", MIXED, num_heads=6, num_kv_heads=2, head_dim=96, block_size=64,
         interpreter=True),
    Case("mqa-d256-bs256", ((1030, 1), (300, 37), (17, 17)), num_heads=4, num_kv_heads=1,
         head_dim=256, block_size=256, interpreter=True),
    Case("d60-odd-dim", ((63, 1), (70, 9)), num_heads=4, num_kv_heads=2, head_dim=60,
         interpreter=True),
    Case("long-decode-2100", ((2100, 1), (1, 1)), interpreter=True),
    Case("window-50", ((1030, 1), (300, 120), (17, 1)), sliding_window=50, interpreter=True),
    Case("window-1", ((63, 1), (40, 40)), sliding_window=1),
    Case("window-longer-than-seq", ((63, 5),), sliding_window=4096),
    Case("softcap-5", ((300, 37), (63, 1)), softcap=5.0, scale=1.0, interpreter=True),
    Case("fp16-mixed", MIXED, dtype=torch.float16, interpreter=True),
    Case("bf16-mixed", MIXED, dtype=torch.bfloat16, interleaved=True, interpreter=True),
    Case("bf16-window-softcap-gqa3", ((600, 1), (200, 33)), num_heads=3, num_kv_heads=1,
         dtype=torch.bfloat16, sliding_window=100, softcap=20.0, scale=0.5, block_size=8),
    Case("fp16-d128-bs128", ((1030, 1), (129, 129)), head_dim=128, block_size=128,
         dtype=torch.float16),
    Case("empty-q-seq", ((30, 0), (20, 2))),
    # Lengths at the CPU kernel's 256-key partition and 16/32-key tile edges, a prefill chunk that
    # straddles a partition, and group 16 (more query rows than one work item takes).
    Case("partition-edges", ((256, 17), (257, 1), (512, 1), (255, 255), (33, 2))),
    Case("gqa16-rows", ((300, 9), (64, 1)), num_heads=16, num_kv_heads=1, head_dim=64),
    Case("gqa128-mqa-wide", ((70, 3),), num_heads=128, num_kv_heads=1, head_dim=16),
    # head_dim <= 32 takes 64-key tiles and 512-key partitions on the CPU: lengths at their
    # edges, a chunk straddling a partition, a window and softcap cutting tiles, fp16 rows.
    Case("d32-edges", ((512, 17), (513, 1), (1030, 1), (64, 64), (65, 3), (600, 200)),
         head_dim=32),
    Case("d32-fp16-window-softcap", ((700, 1), (300, 70)), head_dim=32, dtype=torch.float16,
         sliding_window=100, softcap=10.0),
]


def build(case: Case, seed: int = 0, device: str = "cpu"):
    """Inputs of one case: (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    counts = [math.ceil(seq_len / bs) for seq_len, _ in case.seqs]
    num_blocks = sum(counts) + 3  # spare blocks stay NaN; the last backs unused table entries
    shape = (num_blocks, bs, hkv, dim)
    nan = dict(fill_value=float("nan"), dtype=case.dtype, device=device)
    if case.interleaved:
        kv = torch.full((num_blocks, 2, bs, hkv, dim), **nan)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache, v_cache = torch.full(shape, **nan), torch.full(shape, **nan)
    order = torch.randperm(num_blocks - 1, generator=g)
    width = max(counts) + 2
    wide = torch.full((len(case.seqs), width + 5), num_blocks - 1, dtype=torch.int32,
                      device=device)
    block_tables = wide[:, :width]  # row stride width + 5: not contiguous
    used = 0
    for i, (seq_len, _) in enumerate(case.seqs):
        ids = order[used:used + counts[i]]
        used += counts[i]
        block_tables[i, :counts[i]] = ids.int().to(device)
        for name, cache in (("k", k_cache), ("v", v_cache)):
            rows = torch.randn(seq_len, hkv, dim, generator=g).to(device, case.dtype)
            for j in range(counts[i]):
                n = min(bs, seq_len - j * bs)
                cache[ids[j], :n] = rows[j * bs:j * bs + n]
    q_lens = [q_len for _, q_len in case.seqs]
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), case.num_heads, dim, generator=g).to(device, case.dtype)
    seq_lens = torch.tensor([s for s, _ in case.seqs], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens, cu.to(device)


def kwargs(case: Case) -> dict:
    return dict(scale=case.scale, sliding_window=case.sliding_window, softcap=case.softcap)
