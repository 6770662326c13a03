"""gated_attention_block (csrc/cpu/fused_gated_attention.cpp): Qwen3-Next's attention layer up to
its MLP in one call, against the separate calls it replaces (runner/hybrid_layers.py's
`attention` and the norms around it) bit for bit, and against ops/reference.py's references;
over an explicit case list (decode batch at the bench's heads, GQA 3 with awkward dims and
mixed prefill / decode / chunk rows, full rotary, a bias), every CPU body forced, at one and two
threads; the bf16 sigmoid table against torch's sigmoid on every bf16 value; bad inputs named."""
from __future__ import annotations

import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.gated_attention import (gated_attention_block,
                                            gated_attention_block_unchecked,
                                            ref_gated_attention_block, sigmoid_table)
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.offset_rms_norm import offset_rms_norm
from cb_kernels.ops.paged_attention import _run_cpu

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}

# id: (hidden, num_heads, num_kv_heads, head_dim, rotary_dim, block_size, bias,
#      [(q tokens, KV positions before them)] per sequence)
CASES = {
    "bench-decode-16": (256, 4, 2, 128, 32, 16, False, [(1, 17 + 9 * i) for i in range(16)]),
    "gqa3-mixed-awkward": (72, 6, 2, 40, 10, 4, False, [(7, 0), (1, 13), (5, 6), (1, 2)]),
    "one-row-full-rotary-bias": (64, 2, 1, 16, 16, 8, True, [(1, 5)]),
    # ~1950 (query row, key) pairs: at two threads the attention runs as two calls (three at
    # four threads) over runs of the sequences, prefill chunks on both sides of a cut
    "split-mixed-rows": (64, 4, 2, 32, 16, 4, False, [(9, 20), (1, 40), (1, 7), (12, 0), (1, 33)]),
}
EPS = 1e-6


def paged_sequences(seqs, bs: int, g) -> tuple:
    """(block_tables int32, slot_mapping list, positions list, num_blocks) of sequences
    [(q tokens, KV positions before them)] on shuffled blocks of bs slots, 3 blocks spare."""
    per_seq = [(q + c + bs - 1) // bs for q, c in seqs]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(per_seq) + 1, dtype=torch.int32)
    slots, positions, at = [], [], 0
    for i, ((q, c), nb) in enumerate(zip(seqs, per_seq)):
        tables[i, :nb] = torch.tensor(order[at:at + nb], dtype=torch.int32)
        at += nb
        for p in range(c, c + q):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
            positions.append(p)
    return tables, slots, positions, num_blocks


def make(case, dtype, seed=0, pending=True):
    hidden, heads, kv, hd, rd, bs, bias, seqs = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    n = sum(q for q, _ in seqs)
    lens = [q + c for q, c in seqs]
    tables, slots, positions, num_blocks = paged_sequences(seqs, bs, g)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    emb = torch.cat([torch.tensor(positions).float()[:, None] * inv] * 2, dim=-1)
    qkv_rows = (2 * heads + 2 * kv) * hd
    t = dict(
        x=rnd(n, hidden), pending=rnd(n, hidden) if pending else None,
        in_w=rnd(hidden, s=0.1), post_w=rnd(hidden, s=0.1), q_w=rnd(hd, s=0.1),
        k_w=rnd(hd, s=0.1), cos=emb.cos().to(dtype).contiguous(),
        sin=emb.sin().to(dtype).contiguous(),
        k_cache=rnd(num_blocks, bs, kv, hd), v_cache=rnd(num_blocks, bs, kv, hd),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + [q for q, _ in seqs]).cumsum(0).to(torch.int32))
    w = dict(qkv=rnd(qkv_rows, hidden, s=hidden ** -0.5), o=rnd(hidden, heads * hd, s=0.05),
             qkv_b=rnd(qkv_rows, s=0.1) if bias else None, o_b=rnd(hidden, s=0.1) if bias else None)
    lins = (PackedLinear(w["qkv"], w["qkv_b"]), PackedLinear(w["o"], w["o_b"]))
    return t, w, lins, heads


def _clone(t):
    return {k: None if v is None else v.clone() for k, v in t.items()}


def _fused(t, lins, isa="auto"):
    return gated_attention_block(
        t["x"], t["pending"], t["in_w"], t["post_w"], *lins, t["q_w"], t["k_w"], t["cos"],
        t["sin"], t["k_cache"], t["v_cache"], t["slot_mapping"], t["block_tables"],
        t["seq_lens"], t["cu_seqlens_q"], norm_eps=EPS, scale=0.1, isa=isa)


def _separate(t, lins, heads, isa="auto"):
    """The calls runner/hybrid_layers.py made before (its `attention` between the norms)."""
    x, hd = t["x"], t["k_cache"].shape[3]
    n, kv = x.shape[0], t["k_cache"].shape[2]
    h = offset_rms_norm(x, t["in_w"], EPS, t["pending"], isa=isa)
    qg, k, v = lins[0](h, isa=isa).split([2 * heads * hd, kv * hd, kv * hd], dim=-1)
    qg = qg.view(n, heads, 2 * hd)
    q = offset_rms_norm(qg[..., :hd].reshape(-1, hd), t["q_w"], EPS, isa=isa).view(n, heads, hd)
    k = offset_rms_norm(k.reshape(-1, hd), t["k_w"], EPS, isa=isa).view(n, kv, hd)
    v = v.view(n, kv, hd)
    rd = t["cos"].shape[-1]
    ops.rope_(q[..., :rd], t["cos"], t["sin"], isa=isa)
    ops.rope_(k[..., :rd], t["cos"], t["sin"], isa=isa)
    ops.write_kv_unchecked(k, v, t["k_cache"], t["v_cache"], t["slot_mapping"])
    out = torch.empty_like(q)
    _run_cpu(q, t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], t["cu_seqlens_q"],
             out, 0.1, 0, 0.0, isa=isa)
    out = out.view(n, -1).mul_(qg[..., hd:].reshape(n, -1).sigmoid())
    return offset_rms_norm(x, t["post_w"], EPS, lins[1](out, isa=isa), isa=isa)


def _assert_same(a, b, h_a, h_b):
    assert torch.equal(h_a, h_b)
    for key in ("x", "k_cache", "v_cache"):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("isa", _C.cpu_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_is_the_separate_calls_bit_for_bit(case, dtype, isa):
    t, _, lins, heads = make(case, dtype)
    sep = _clone(t)
    want = _separate(sep, lins, heads, isa)
    got = _fused(t, lins, isa)
    assert got.dtype == dtype and got.shape == t["x"].shape
    _assert_same(t, sep, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_first_layer_without_pending(dtype):
    t, _, lins, heads = make("gqa3-mixed-awkward", dtype, seed=1, pending=False)
    sep = _clone(t)
    _assert_same(t, sep, _fused(t, lins), _separate(sep, lins, heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    t, w, lins, heads = make(case, dtype, seed=2)
    ref = _clone(t)
    want = ref_gated_attention_block(
        ref["x"], ref["pending"], ref["in_w"], ref["post_w"], w["qkv"], w["qkv_b"], w["o"],
        w["o_b"], ref["q_w"], ref["k_w"], ref["cos"], ref["sin"], ref["k_cache"], ref["v_cache"],
        ref["slot_mapping"], ref["block_tables"], ref["seq_lens"], ref["cu_seqlens_q"],
        num_heads=heads, norm_eps=EPS, scale=0.1)
    got = _fused(t, lins)
    torch.testing.assert_close(got, want, **TOL[dtype])
    for key in ("x", "k_cache", "v_cache"):
        torch.testing.assert_close(t[key], ref[key], **TOL[dtype])


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_more_threads_are_the_separate_calls_at_one(case, dtype, threads):
    """At two and four threads (the attention split into a call a thread over runs of the
    sequences where the kernel would keep it on one thread: 2-4 parts here) the call gives the
    bits of the separate calls at one thread."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t, _, lins, heads = make(case, dtype, seed=3)
        sep = _clone(t)
        want = _separate(sep, lins, heads)
        torch.set_num_threads(threads)
        got = _fused(t, lins)
    finally:
        torch.set_num_threads(saved)
    _assert_same(t, sep, got, want)


def test_sigmoid_table_is_torchs_sigmoid_of_every_bf16_value():
    """The bf16 gate reads torch.sigmoid from the table: it must be torch's result for every
    value, whether torch's vector loop or its scalar tail computes it (NaN in, NaN out: torch's
    two loops write different NaN bits there)."""
    table = sigmoid_table()
    values = torch.cat([torch.arange(0, 32768), torch.arange(-32768, 0)]).to(torch.int16)
    values = values.view(torch.bfloat16)
    nan = values.isnan()
    assert 0 < nan.sum() < 1024 and table.view(torch.bfloat16)[nan].isnan().all()

    def same(got, index):
        keep = ~nan[index]
        assert torch.equal(got.view(torch.int16)[keep], table[index][keep])

    same(torch.sigmoid(values), slice(None))
    for start in range(1, 32):          # every element once in a scalar tail position
        same(torch.sigmoid(values[start:]), slice(start, None))
        same(torch.sigmoid(values[start::32]), slice(start, None, 32))


def test_bf16_gate_from_the_table_equals_a_given_sigmoid():
    """The two C++ halves with torch's sigmoid of the gate between them (fp32's path) give the
    table's bits in bf16 too."""
    t, _, lins, heads = make("gqa3-mixed-awkward", torch.bfloat16, seed=4)
    two = _clone(t)
    got = _fused(t, lins)
    n, hd = t["x"].shape[0], t["k_cache"].shape[3]
    size = (n, t["x"].shape[1], heads, 2, hd, t["cos"].shape[1], 4,
            two["block_tables"].shape[1], two["block_tables"].stride(0),
            *two["k_cache"].shape[:2], *two["k_cache"].stride()[:3], *two["v_cache"].stride()[:3])
    ws = torch.empty(_C.gated_attention_workspace_bytes(size, 2), dtype=torch.uint8)
    h = torch.empty_like(got)
    ptr = [two["x"].data_ptr(), two["pending"].data_ptr(), two["in_w"].data_ptr(),
           two["post_w"].data_ptr(), two["q_w"].data_ptr(), two["k_w"].data_ptr(),
           lins[0].packed.data_ptr(), 0, lins[1].packed.data_ptr(), 0, two["cos"].data_ptr(),
           two["sin"].data_ptr(), 0, 0, h.data_ptr(), ws.data_ptr(), two["k_cache"].data_ptr(),
           two["v_cache"].data_ptr(), two["slot_mapping"].data_ptr(),
           two["block_tables"].data_ptr(), two["seq_lens"].data_ptr(),
           two["cu_seqlens_q"].data_ptr()]
    f = (EPS, EPS, EPS, EPS, 0.1)
    _C.gated_attention_qkv(ptr, size, f, "auto", 2)
    qkv = ws[:n * lins[0].n * 2].view(torch.bfloat16).view(n, -1)
    gate = qkv[:, :2 * heads * hd].view(n, heads, 2 * hd)[..., hd:].reshape(n, -1).sigmoid()
    ptr[12] = gate.data_ptr()
    _C.gated_attention_rest(ptr, size, f, "auto", 2)
    _assert_same(t, two, got, h)
    with pytest.raises(RuntimeError, match="one call needs bf16 and sigmoid_table"):
        _C.gated_attention_block(ptr, size, f, "auto", 0)
    ptr[12] = 0      # no sigmoid at all: refused before anything is written
    before = _clone(two)
    with pytest.raises(RuntimeError, match="need gate_sigmoid"):
        _C.gated_attention_rest(ptr, size, f, "auto", 2)
    for key in ("x", "k_cache", "v_cache"):
        assert torch.equal(two[key], before[key])


def test_registered_op_matches_the_call():
    t, _, lins, heads = make("gqa3-mixed-awkward", torch.float32, seed=5)
    op = _clone(t)
    want = _fused(t, lins)
    got = torch.ops.cb_kernels.gated_attention_block(
        op["x"], op["pending"], op["in_w"], op["post_w"], lins[0].packed, lins[0].bias,
        lins[1].packed, lins[1].bias, op["q_w"], op["k_w"], op["cos"], op["sin"], op["k_cache"],
        op["v_cache"], op["slot_mapping"], op["block_tables"], op["seq_lens"],
        op["cu_seqlens_q"], heads, EPS, 0.1)
    _assert_same(t, op, want, got)
    args = (op["x"], op["pending"], op["in_w"], op["post_w"], lins[0].packed, lins[0].bias,
            lins[1].packed, lins[1].bias, op["q_w"], op["k_w"], op["cos"], op["sin"],
            op["k_cache"], op["v_cache"], op["slot_mapping"], op["block_tables"], op["seq_lens"],
            op["cu_seqlens_q"], heads, EPS, 0.1)
    result = torch.library.opcheck(torch.ops.cb_kernels.gated_attention_block.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}


def test_empty_step_returns_empty_rows():
    t, _, lins, _ = make("one-row-full-rotary-bias", torch.float32)
    for key in ("x", "pending", "cos", "sin"):
        t[key] = t[key][:0]
    t["slot_mapping"], t["cu_seqlens_q"] = t["slot_mapping"][:0], torch.zeros(2, dtype=torch.int32)
    t["seq_lens"] = torch.tensor([5], dtype=torch.int32)
    assert _fused(t, lins).shape == (0, 64)


def _bad(t, lins, **change):
    args = dict(t, **change)
    return lambda: _fused(args, lins)


def test_bad_inputs_name_the_argument():
    t, _, lins, _ = make("gqa3-mixed-awkward", torch.float32)
    cases = [
        (dict(x=t["x"].to(torch.bfloat16)), TypeError, "pending must have dtype"),
        (dict(x=t["x"].t()), ValueError, "x must be contiguous"),
        (dict(pending=t["pending"][:-1]), ValueError, "pending must be x's shape"),
        (dict(q_w=t["q_w"][:-1]), ValueError, r"q_norm_weight must be \[40\]"),
        (dict(post_w=t["post_w"].to(torch.bfloat16)), TypeError, "post_norm_weight must have"),
        (dict(cos=t["cos"][:, :9]), ValueError, "cos must be"),
        (dict(sin=t["sin"][:-1]), ValueError, "sin must be"),
        (dict(v_cache=t["v_cache"][:-1]), ValueError, "v_cache shape"),
        (dict(slot_mapping=t["slot_mapping"].int()), TypeError, "slot_mapping must have dtype"),
        (dict(slot_mapping=t["slot_mapping"] + 10_000), ValueError, "slot"),
        (dict(seq_lens=t["seq_lens"][:-1]), ValueError, "seq_lens must have num_seqs"),
        (dict(seq_lens=t["seq_lens"] - 6), ValueError, "q tokens"),
        (dict(block_tables=t["block_tables"] + 100), ValueError, "outside the pool"),
    ]
    for change, err, msg in cases:
        with pytest.raises(err, match=msg):
            _bad(t, lins, **change)()
    with pytest.raises(TypeError, match="qkv_proj must be an ops.PackedLinear"):
        _fused(t, (lins[0].packed, lins[1]))
    with pytest.raises(ValueError, match="o_proj must be"):
        _fused(t, (lins[0], lins[0]))
    with pytest.raises(ValueError, match="qkv_proj must have"):
        _fused(t, (lins[1], lins[1]))


def test_unchecked_refuses_bad_indices_before_writing():
    """The engine's path skips the Python checks; the C++ still refuses block ids outside the
    pool, before x or a cache is written."""
    t, _, lins, heads = make("gqa3-mixed-awkward", torch.bfloat16)
    before = _clone(t)
    with pytest.raises(RuntimeError, match="invalid block_tables"):
        gated_attention_block_unchecked(
            t["x"], t["pending"], t["in_w"], t["post_w"], lins[0].packed, None, lins[1].packed,
            None, t["q_w"], t["k_w"], t["cos"], t["sin"], t["k_cache"], t["v_cache"],
            t["slot_mapping"], t["block_tables"] + 1000, t["seq_lens"], t["cu_seqlens_q"], heads,
            (EPS,) * 4, 0.1)
    for key in ("x", "k_cache", "v_cache"):
        assert torch.equal(t[key], before[key])
