"""FusedDecoder (csrc/cpu/fused_decoder.cpp) against ops/reference.py's ref_fused_decoder, the
same stack as a loop over the per-op references: the final rows, the residual stream left in x
and every layer's K/V cache, over an explicit case list (GQA, MHA, a window on one layer, biases,
prefill + chunked prefill + decode in one batch), and the registered op's schema."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_fused_decoder

# (atol, rtol) of the rows, the residual stream and the caches against the reference. fp32: the
# reference's linears run in float64, the kernels' in fp32 in another order; measured at most
# 2.2e-6 on values up to ~10 over these cases. bf16: every linear, norm and product rounds to
# bf16 and those roundings fall differently from the reference's (float64 linears, fp32
# attention); measured one bf16 unit (0.031 on values in [4, 8)); a unit at [8, 16) is 0.0625.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (6e-2, 4e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 64
    intermediate: int = 96
    windows: tuple = (None, None)        # one per layer
    bias: bool = False
    dtype: torch.dtype = torch.float32
    # (seq_len, q_len) per sequence: a prefill, a decode, a chunk of a longer prefill
    seqs: tuple = ((7, 7), (21, 1), (13, 5))
    block_size: int = 4


CASES = [
    Case("fp32-gqa"),
    Case("fp32-mha", kv_heads=4),
    Case("fp32-window-on-layer-1", windows=(None, 6)),
    Case("fp32-biases", bias=True),
    Case("fp32-one-decode", seqs=((9, 1),)),
    Case("bf16-gqa-d32", head_dim=32, heads=2, kv_heads=1, dtype=torch.bfloat16),
    Case("bf16-biases-window", bias=True, windows=(5, None), dtype=torch.bfloat16),
]


def _inputs(case: Case, seed: int = 0):
    """The step's tensors, the layers' weights (plain tensors) and caches whose slots the batch
    does not own hold NaN (a wrong read fails loudly); earlier positions hold random K/V."""
    g = torch.Generator().manual_seed(seed)
    dt, d, bs = case.dtype, case.head_dim, case.block_size

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)
    q_n, kv_n = case.heads * d, case.kv_heads * d
    layers = []
    for window in case.windows:
        def lin(n, k):
            return randn(n, k, scale=k ** -0.5), randn(n, scale=0.1) if case.bias else None
        layers.append((1 + randn(case.hidden, scale=0.1), 1 + randn(case.hidden, scale=0.1),
                       lin(q_n + 2 * kv_n, case.hidden), lin(case.hidden, q_n),
                       lin(2 * case.intermediate, case.hidden),
                       lin(case.hidden, case.intermediate), window))
    num_seqs = len(case.seqs)
    max_blocks = max(-(-s // bs) for s, _ in case.seqs) + 1
    num_blocks = num_seqs * max_blocks + 2
    ids = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    block_tables = ids.to(torch.int32)
    k_caches = [torch.full((num_blocks, bs, case.kv_heads, d), float("nan"), dtype=dt)
                for _ in layers]
    v_caches = [c.clone() for c in k_caches]
    positions, slots = [], []
    for i, (seq_len, q_len) in enumerate(case.seqs):
        for pos in range(seq_len):
            block, off = int(ids[i, pos // bs]), pos % bs
            if pos < seq_len - q_len:        # context already in the cache
                for c in k_caches + v_caches:
                    c[block, off] = randn(case.kv_heads, d)
            else:
                positions.append(pos)
                slots.append(block * bs + off)
    positions = torch.tensor(positions)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    x = randn(len(slots), case.hidden)
    cu = torch.tensor([0] + [q for _, q in case.seqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for s, _ in case.seqs], dtype=torch.int32)
    step = dict(x=x, cos=cos, sin=sin, final_norm=1 + randn(case.hidden, scale=0.1),
                slot_mapping=torch.tensor(slots), block_tables=block_tables, seq_lens=seq_lens,
                cu_seqlens_q=cu)
    return step, layers, k_caches, v_caches


def _decoder(case: Case) -> ops.FusedDecoder:
    return ops.FusedDecoder(hidden=case.hidden, heads=case.heads, kv_heads=case.kv_heads,
                            head_dim=case.head_dim, intermediate=case.intermediate, eps=1e-5,
                            scale=case.head_dim ** -0.5, dtype=case.dtype)


def _table(dec: ops.FusedDecoder, layers, k_caches, v_caches) -> tuple[list, list]:
    """(layer table, the PackedLinears its addresses point into: keep them alive while it is
    used)."""
    packed = [[ops.PackedLinear(*lin) for lin in layer[2:6]] for layer in layers]
    table = dec.layer_table([(layer[0], layer[1], *lins, layer[6])
                             for layer, lins in zip(layers, packed)], k_caches, v_caches)
    return table, packed


def _run(case: Case, step, layers, k_caches, v_caches):
    dec = _decoder(case)
    table, _packed = _table(dec, layers, k_caches, v_caches)
    s = step
    return dec(s["x"], s["cos"], s["sin"], table, s["final_norm"], s["slot_mapping"],
               s["block_tables"], s["seq_lens"], s["cu_seqlens_q"], k_caches[0], v_caches[0])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case):
    step, layers, k_caches, v_caches = _inputs(case)
    ref_step = {k: v.clone() for k, v in step.items()}
    ref_k, ref_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    got = _run(case, step, layers, k_caches, v_caches)
    want = ref_fused_decoder(
        ref_step["x"], ref_step["cos"], ref_step["sin"], layers, ref_step["final_norm"],
        ref_step["slot_mapping"], ref_step["block_tables"], ref_step["seq_lens"],
        ref_step["cu_seqlens_q"], ref_k, ref_v, heads=case.heads, kv_heads=case.kv_heads,
        head_dim=case.head_dim, eps=1e-5, scale=case.head_dim ** -0.5)
    atol, rtol = TOLERANCES[case.dtype]
    assert got.dtype == case.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(step["x"], ref_step["x"], atol=atol, rtol=rtol)   # residual stream
    for layer, (a, b) in enumerate(zip(k_caches + v_caches, ref_k + ref_v)):
        # slots the batch does not own stay NaN in both; the written ones agree
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, equal_nan=True,
                                   msg=lambda m: f"cache {layer}: {m}")


def test_registered_op_opcheck():
    """The schema (x and layer 0's caches mutated, a new output) and the fake kernel. The
    dispatch tests that rerun the op on functionalised copies are left out: the kernel writes the
    caches through the table's addresses, not through the copies."""
    case = CASES[0]
    step, layers, k_caches, v_caches = _inputs(case)
    table, _packed = _table(_decoder(case), layers, k_caches, v_caches)
    s = step
    args = (s["x"], s["cos"], s["sin"], table, s["final_norm"], s["slot_mapping"],
            s["block_tables"], s["seq_lens"], s["cu_seqlens_q"], k_caches[0], v_caches[0],
            case.hidden, case.heads, case.kv_heads, case.head_dim, case.intermediate, 1e-5,
            case.head_dim ** -0.5)
    torch.library.opcheck(torch.ops.cb_kernels.fused_decoder.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
