"""paged_attention's shared-prefix groups (csrc/cpu/paged_attention.cpp, run_group): decode rows
whose block tables begin with the same physical blocks (the n samples of one prompt) are run
as one item over those blocks, then each over its own tail. The grouping is invisible: every
layout gives the bits the kernel gives when no row shares a block (the same K/V copied into
blocks of each row's own), and matches the reference.

Layouts are built as the engine's fork() leaves them: a prompt's full blocks shared by its
samples, a sample's tail (the prompt's partial block and its decoded tokens) in blocks of its
own; unused cache slots and table entries are NaN / point at a NaN block.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.paged_attention import _run_cpu, check_args
from cb_kernels.ops.reference import ref_paged_attention
from paged_attention_cases import tolerance


@dataclasses.dataclass(frozen=True)
class Layout:
    id: str
    # one entry per prompt: (prompt length, sample tail lengths); a sample's seq_len is the
    # prompt length plus its tail; a tail of None is a prefill row of that prompt's length
    # instead (its own blocks, q_len = its length)
    prompts: tuple
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    softcap: float | None = None
    sinks: bool = False
    common: int = 0   # leading full blocks every prompt shares (a cached system prompt)


LAYOUTS = [
    Layout("n8-smollm2", ((38, (1, 5, 9, 13, 17, 21, 25, 64)), (70, (3,) * 8))),
    Layout("groups-1-to-8", tuple((16 * g + 7, tuple(range(1, g + 1))) for g in range(1, 9))),
    Layout("prefix-0-blocks", ((9, (1, 2, 3, 4)), (15, (2, 2)))),
    Layout("prefix-exact", ((32, (0, 0, 0)), (48, (0, 5, 0)))),
    Layout("mixed-prefill-unshared", ((40, (2, 2, 2)), (33, None), (50, (7,)), (64, (1, 9)),
                                      (20, None), (45, (4, 4, 4, 4, 4)))),
    Layout("gqa1", ((37, (1, 2, 3, 4, 5)),), num_heads=4, num_kv_heads=4),
    Layout("gqa2", ((37, (1, 2, 3, 4, 5)),), num_heads=4, num_kv_heads=2),
    Layout("gqa8-d128", ((70, (1, 20, 3, 40)), (33, (6, 6))), num_heads=16, num_kv_heads=2,
           head_dim=128),
    Layout("d32-64-key-tiles", ((130, (1, 2, 70, 4)), (64, (0, 1))), num_heads=8,
           num_kv_heads=2, head_dim=32),
    Layout("bs8", ((41, (1, 2, 3)), (18, (5, 5))), block_size=8),
    Layout("bs32", ((70, (1, 2, 3)), (33, (40, 5))), block_size=32),
    Layout("odd-dim-60", ((40, (1, 2, 3, 4)),), head_dim=60),
    Layout("fp16", ((38, (1, 5, 9, 13)),), dtype=torch.float16),
    Layout("softcap-sinks", ((38, (1, 5, 9, 13)), (17, (2, 3))), softcap=20.0, sinks=True),
    Layout("past-one-partition", ((250, (1, 3, 9)), (40, (1, 1)))),
    Layout("many-groups", tuple((30 + 3 * i, (1, 2, 3, 4, 5, 6, 7, 8)) for i in range(12))),
    Layout("system-prompt-block", tuple((40 + 5 * i, (1, 2, 3, 4, 5, 6, 7, 8)) for i in range(6))
           + ((20, (3,)), (50, None), (36, (1, 2))), common=1),
    Layout("system-prompt-d32", tuple((150 + 9 * i, (1, 5, 9)) for i in range(5)), num_heads=8,
           num_kv_heads=2, head_dim=32, common=2),
]


def build(layout: Layout, shared: bool, seed: int = 0):
    """(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, sinks) of the layout, with the
    prompts' full blocks shared by their samples (shared=True) or copied into blocks of each
    sample's own (shared=False: the same values, nothing for the kernel to group)."""
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    rows = []   # per row: (list of block contents [bs, kvh, d] x2, seq_len, q_len)
    common_k = torch.randn(layout.common * bs, kvh, d, generator=g)
    common_v = torch.randn(layout.common * bs, kvh, d, generator=g)
    for plen, tails in layout.prompts:
        if tails is None:
            rows.append((plen, plen, None))
            continue
        full = plen // bs
        prompt_k = torch.randn(plen, kvh, d, generator=g)
        prompt_v = torch.randn(plen, kvh, d, generator=g)
        prompt_k[:layout.common * bs], prompt_v[:layout.common * bs] = common_k, common_v
        for t in tails:
            rows.append((plen + max(t, 1) if t else plen, 1, (full, prompt_k, prompt_v, plen)))
    blocks_k, blocks_v, tables = [], [], []
    prompt_blocks = {}
    for seq_len, q_len, src in rows:
        keys = torch.randn(seq_len, kvh, d, generator=g)
        values = torch.randn(seq_len, kvh, d, generator=g)
        table, full = [], 0
        if src is not None:
            full, pk, pv, plen = src
            keys[:plen], values[:plen] = pk, pv
            if shared and "common" not in prompt_blocks:
                prompt_blocks["common"] = list(range(len(blocks_k), len(blocks_k) + layout.common))
                blocks_k.extend(common_k[b * bs:(b + 1) * bs] for b in range(layout.common))
                blocks_v.extend(common_v[b * bs:(b + 1) * bs] for b in range(layout.common))
            if shared and id(pk) not in prompt_blocks:
                ids = list(prompt_blocks["common"])
                for b in range(layout.common, full):
                    ids.append(len(blocks_k))
                    blocks_k.append(pk[b * bs:(b + 1) * bs])
                    blocks_v.append(pv[b * bs:(b + 1) * bs])
                prompt_blocks[id(pk)] = ids
            if shared:
                table += prompt_blocks[id(pk)]
            else:
                full = 0
        for b in range(full, -(-seq_len // bs)):
            kb = torch.full((bs, kvh, d), float("nan"))
            vb = torch.full((bs, kvh, d), float("nan"))
            n = min(bs, seq_len - b * bs)
            kb[:n], vb[:n] = keys[b * bs:b * bs + n], values[b * bs:b * bs + n]
            table.append(len(blocks_k))
            blocks_k.append(kb)
            blocks_v.append(vb)
        tables.append(table)
    nan_block = len(blocks_k)
    blocks_k.append(torch.full((bs, kvh, d), float("nan")))
    blocks_v.append(torch.full((bs, kvh, d), float("nan")))
    width = max(len(t) for t in tables) + 1
    block_tables = torch.full((len(tables), width), nan_block, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    dtype = layout.dtype
    k_cache = torch.stack(blocks_k).to(dtype)
    v_cache = torch.stack(blocks_v).to(dtype)
    seq_lens = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    q_lens = torch.tensor([r[1] for r in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu[-1]), layout.num_heads, d, generator=g).to(dtype)
    sinks = torch.randn(layout.num_heads, generator=g) if layout.sinks else None
    return q, k_cache, v_cache, block_tables, seq_lens, cu, sinks


def run(layout: Layout, shared: bool, isa: str = "auto") -> torch.Tensor:
    q, k, v, bt, sl, cu, sinks = build(layout, shared)
    out = torch.empty_like(q)
    scale, window, cap = check_args(q, k, v, bt, sl, cu, None, None, layout.softcap, None)
    _run_cpu(q, k, v, bt, sl, cu, out, scale, window, cap, isa=isa, sinks=sinks)
    return out


def test_layouts_share_what_they_say():
    """The builder shares a prompt's full blocks among its samples (same physical ids leading
    their tables) and nothing else; without sharing no two rows hold a block in common."""
    layout = next(x for x in LAYOUTS if x.id == "n8-smollm2")
    _, _, _, bt, sl, _, _ = build(layout, shared=True)
    assert torch.equal(bt[0, :2], bt[7, :2]) and bt[0, 2] != bt[1, 2]
    assert torch.equal(bt[8, :4], bt[15, :4]) and bt[8, 4] != bt[9, 4]
    assert bt[0, 0] != bt[8, 0]
    _, _, _, bt, sl, _, _ = build(layout, shared=False)
    used = [int(b) for i in range(bt.shape[0]) for b in bt[i, :-(-int(sl[i]) // 16)]]
    assert len(used) == len(set(used))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", ["auto", "avx2", "portable"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.id)
def test_shared_blocks_give_the_unshared_bits(layout, isa, threads):
    """Rows that share their prompt's blocks get exactly the bits they get from private copies
    of those blocks (no group possible), on every body and thread count, and match the
    reference."""
    from cb_kernels import _C

    if isa != "auto" and isa not in _C.cpu_isas():
        pytest.fail(f"{isa}: this CPU runs only {_C.cpu_isas()}")
    torch.set_num_threads(threads)      # conftest restores it
    grouped = run(layout, shared=True, isa=isa)
    alone = run(layout, shared=False, isa=isa)
    assert not grouped.isnan().any()
    assert torch.equal(grouped, alone)
    q, k, v, bt, sl, cu, sinks = build(layout, shared=True)
    expected = ref_paged_attention(q, k, v, bt, sl, cu, softcap=layout.softcap, sinks=sinks)
    torch.testing.assert_close(grouped, expected, **tolerance(layout.dtype))


def test_a_system_prompt_block_is_shared_by_every_prompt():
    """The common-block layout shares its first block across prompts and two blocks within one."""
    layout = next(x for x in LAYOUTS if x.id == "system-prompt-block")
    _, _, _, bt, _, _, _ = build(layout, shared=True)
    assert (bt[:48, 0] == bt[0, 0]).all() and bt[7, 1] != bt[8, 1] and bt[8, 1] == bt[15, 1]


def test_one_thread_and_two_give_the_same_bits():
    """The thread split (which cuts groups shorter to feed every thread) leaves the bits."""
    layout = next(x for x in LAYOUTS if x.id == "many-groups")
    torch.set_num_threads(1)
    one = run(layout, shared=True)
    torch.set_num_threads(2)
    two = run(layout, shared=True)
    assert torch.equal(one, two)


def test_a_row_alone_gets_its_grouped_bits():
    """A sample decoded alone (no group) gets the bits it gets inside its group of 8."""
    layout = LAYOUTS[0]
    q, k, v, bt, sl, cu, _ = build(layout, shared=True)
    full = ops.paged_attention(q, k, v, bt, sl, cu, backend="cpu")
    for i in (0, 3, 7, 8, 15):
        one = ops.paged_attention(q[i:i + 1], k, v, bt[i:i + 1], sl[i:i + 1],
                                  torch.tensor([0, 1], dtype=torch.int32), backend="cpu")
        assert torch.equal(one[0], full[i]), f"row {i}"
