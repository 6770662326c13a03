"""The one case class, input builder and tolerance table of the paged-attention tests
(test_paged_attention.py, test_paged_attention_triton.py, test_paged_attention_cuda_emu.py).

Inputs are built to make wrong reads fail loudly: every cache slot a sequence does not own is NaN,
block tables are shuffled, non-contiguous column slices whose unused entries point at a NaN block.
"""
from __future__ import annotations

import dataclasses
import math

import torch

# (atol, rtol) against the fp32 reference rounded to the dtype. Outputs are convex mixes of N(0, 1)
# values (|out| < ~3): fp16/bf16 outputs may differ by one unit in the last place of a value near
# 1, fp32 ones by the reordering of a few thousand fp32 products and sums.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}



def tolerance(dtype: torch.dtype) -> dict:
    """assert_close's atol and rtol for outputs of this dtype."""
    atol, rtol = TOLERANCES[dtype]
    return dict(atol=atol, rtol=rtol)


# How k_cache and v_cache sit in memory: two tensors, or strided views of one buffer with K and V
# side by side inside each block ([num_blocks, 2, block_size, ...], transformers' paged cache) or
# inside each token ([num_blocks, block_size, 2, ...]).
KV_LAYOUTS = ("separate", "kv-per-block", "kv-per-token")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    seq_lens: tuple[int, ...]  # KV length of each sequence, its new tokens included
    q_lens: tuple[int, ...]    # new tokens of each sequence (its last positions); 1 = decode
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    kv_layout: str = "separate"
    interpreter: bool = False  # small enough for the Triton interpreter (< ~5 s)

    def __post_init__(self):
        assert len(self.seq_lens) == len(self.q_lens), self.id
        assert all(0 <= q <= s for s, q in zip(self.seq_lens, self.q_lens)), self.id
        assert self.kv_layout in KV_LAYOUTS, self.id

    @property
    def tolerance(self) -> dict:
        return tolerance(self.dtype)


# Decodes (lengths at block edges, a long one), a whole prefill and a prefill chunk in one batch.
MIXED = dict(seq_lens=(1, 17, 63, 1030, 40, 300), q_lens=(1, 1, 1, 1, 40, 37))


def build(case: Case, device: str = "cpu", seed: int = 0):
    """Inputs of one case: (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    counts = [math.ceil(seq_len / bs) for seq_len in case.seq_lens]
    num_blocks = sum(counts) + 3  # spare blocks stay NaN; the last backs unused table entries
    nan = dict(fill_value=float("nan"), dtype=case.dtype, device=device)
    if case.kv_layout == "kv-per-block":
        kv = torch.full((num_blocks, 2, bs, hkv, dim), **nan)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    elif case.kv_layout == "kv-per-token":
        kv = torch.full((num_blocks, bs, 2, hkv, dim), **nan)
        k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    else:
        shape = (num_blocks, bs, hkv, dim)
        k_cache, v_cache = torch.full(shape, **nan), torch.full(shape, **nan)
    order = torch.randperm(num_blocks - 1, generator=g)
    width = max(counts) + 2
    wide = torch.full((len(case.seq_lens), width + 5), num_blocks - 1, dtype=torch.int32,
                      device=device)
    block_tables = wide[:, :width]  # row stride width + 5: not contiguous
    used = 0
    for i, seq_len in enumerate(case.seq_lens):
        ids = order[used:used + counts[i]]
        used += counts[i]
        block_tables[i, :counts[i]] = ids.int().to(device)
        for cache in (k_cache, v_cache):
            rows = torch.randn(seq_len, hkv, dim, generator=g).to(device, case.dtype)
            for j in range(counts[i]):
                n = min(bs, seq_len - j * bs)
                cache[ids[j], :n] = rows[j * bs:j * bs + n]
    cu = torch.tensor((0,) + case.q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), case.num_heads, dim, generator=g).to(device, case.dtype)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens, cu.to(device)


def kwargs(case: Case) -> dict:
    """The case's keyword arguments of paged_attention and ref_paged_attention."""
    return dict(scale=case.scale, sliding_window=case.sliding_window, softcap=case.softcap)


CASES = [
    Case("decode-len1", seq_lens=(1,), q_lens=(1,), interpreter=True),
    Case("mixed-gqa4-d64-bs16", **MIXED, interpreter=True),
    Case("mixed-gqa1-d80-bs8", **MIXED, num_heads=4, num_kv_heads=4, head_dim=80, block_size=8),
    Case("mixed-gqa8-d128-bs32-kv-per-block", **MIXED, num_heads=16, num_kv_heads=2, head_dim=128,
         block_size=32, kv_layout="kv-per-block"),
    Case("mixed-gqa3-d96-bs64", **MIXED, num_heads=6, num_kv_heads=2, head_dim=96, block_size=64,
         interpreter=True),
    Case("mqa-d256-bs256", seq_lens=(1030, 300, 17), q_lens=(1, 37, 17), num_heads=4,
         num_kv_heads=1, head_dim=256, block_size=256, interpreter=True),
    Case("d60-odd-dim", seq_lens=(63, 70), q_lens=(1, 9), num_heads=4, num_kv_heads=2,
         head_dim=60, interpreter=True),
    Case("long-decode-2100", seq_lens=(2100, 1), q_lens=(1, 1), interpreter=True),
    Case("window-50", seq_lens=(1030, 300, 17), q_lens=(1, 120, 1), sliding_window=50,
         interpreter=True),
    Case("window-1", seq_lens=(63, 40), q_lens=(1, 40), sliding_window=1),
    Case("window-longer-than-seq", seq_lens=(63,), q_lens=(5,), sliding_window=4096),
    Case("softcap-5", seq_lens=(300, 63), q_lens=(37, 1), softcap=5.0, scale=1.0, interpreter=True),
    Case("fp16-mixed", **MIXED, dtype=torch.float16, interpreter=True),
    Case("bf16-mixed-kv-per-block", **MIXED, dtype=torch.bfloat16, kv_layout="kv-per-block",
         interpreter=True),
    Case("bf16-window-softcap-gqa3", seq_lens=(600, 200), q_lens=(1, 33), num_heads=3,
         num_kv_heads=1, dtype=torch.bfloat16, sliding_window=100, softcap=20.0, scale=0.5,
         block_size=8),
    Case("fp16-d128-bs128", seq_lens=(1030, 129), q_lens=(1, 129), head_dim=128, block_size=128,
         dtype=torch.float16),
    Case("empty-q-seq", seq_lens=(30, 20), q_lens=(0, 2)),
    # Fewer tokens than sequences: no prefill launch on CUDA/Triton, so the decode launch must
    # also cover the q_len 3 row (it did only at num_tokens == num_seqs).
    Case("qlen0-fewer-tokens-than-seqs", seq_lens=(5, 7, 9, 12, 20), q_lens=(0, 0, 0, 1, 3),
         num_heads=4, interpreter=True),
    Case("kv-per-token-views", seq_lens=(100, 30), q_lens=(1, 7), num_heads=4,
         kv_layout="kv-per-token", interpreter=True),
    # Lengths at the CPU kernel's 256-key partition and 16/32-key tile edges, a prefill chunk that
    # straddles a partition, and group 16 (more query rows than one work item takes).
    Case("partition-edges", seq_lens=(256, 257, 512, 255, 33), q_lens=(17, 1, 1, 255, 2)),
    Case("gqa16-rows", seq_lens=(300, 64), q_lens=(9, 1), num_heads=16, num_kv_heads=1),
    Case("gqa128-mqa-wide", seq_lens=(70,), q_lens=(3,), num_heads=128, num_kv_heads=1,
         head_dim=16),
    # head_dim <= 32 takes 64-key tiles and 512-key partitions on the CPU: lengths at their
    # edges, a chunk straddling a partition, a window and softcap cutting tiles, fp16 rows.
    Case("d32-edges", seq_lens=(512, 513, 1030, 64, 65, 600), q_lens=(17, 1, 1, 64, 3, 200),
         head_dim=32),
    Case("d32-fp16-window-softcap", seq_lens=(700, 300), q_lens=(1, 70), head_dim=32,
         dtype=torch.float16, sliding_window=100, softcap=10.0),
    # bf16 with head_dim % 32 == 0 takes the vdpbf16ps kernel where the CPU has AVX512-BF16:
    # odd key counts (key pairs), row blocks of 4 plus remainders, partitions, d 32/128/256,
    # per-token views, windows.
    Case("bf16-partition-edges", seq_lens=(256, 257, 513, 255, 33), q_lens=(17, 1, 1, 255, 2),
         dtype=torch.bfloat16),
    Case("bf16-gqa16-rows", seq_lens=(300, 65), q_lens=(9, 1), num_heads=16, num_kv_heads=1,
         dtype=torch.bfloat16),
    Case("bf16-gqa8-d128-bs32", seq_lens=(1030, 300, 17), q_lens=(1, 37, 17), num_heads=16,
         num_kv_heads=2, head_dim=128, block_size=32, dtype=torch.bfloat16),
    Case("bf16-d32-edges-window", seq_lens=(512, 513, 64, 65, 600), q_lens=(17, 1, 64, 3, 200),
         head_dim=32, dtype=torch.bfloat16, sliding_window=70),
    Case("bf16-mqa-d256-per-token", seq_lens=(100, 31), q_lens=(1, 7), num_heads=5,
         num_kv_heads=1, head_dim=256, dtype=torch.bfloat16, kv_layout="kv-per-token"),
]
