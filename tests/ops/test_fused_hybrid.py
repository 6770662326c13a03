"""gated_delta_net and mamba2_mixer (csrc/cpu/fused_hybrid.cpp) against ops/fused_hybrid.py's
references and against the separate ops they chain, over an explicit case list: grouped heads,
awkward dims, decodes, fresh prefills and continued chunks in one call, empty rows, strided
projection rows; every CPU body forced; results independent of the thread count."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_kernels import _C, ops
from cb_kernels.ops.fused_hybrid import (gated_delta_net, mamba2_mixer, ref_gated_delta_net,
                                         ref_mamba2_mixer)
from tests.helpers import assert_same_at_threads

_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}

# id: (num_k_heads, num_v_heads, k_dim, v_dim, conv width, [(row length, continues)])
GDN_CASES = {
    "decode-one-row": (1, 1, 16, 16, 4, [(1, True)]),
    "hd128-decode-batch": (2, 4, 128, 128, 4, [(1, True)] * 5),
    "mixed-rows-awkward": (2, 6, 20, 37, 3, [(1, True), (7, False), (0, False), (3, True)]),
}
# id: (num_heads, head_dim, num_groups, d_state, norm groups, conv width, rows)
MAMBA_CASES = {
    "decode-one-row": (2, 8, 1, 16, 1, 4, [(1, True)]),
    "ds128-decode-batch": (8, 64, 1, 128, 1, 4, [(1, True)] * 5),
    "mixed-rows-groups": (6, 12, 2, 24, 2, 3, [(1, True), (6, False), (0, False), (2, True)]),
}


def _rows(rows, num_slots, gen):
    slots = torch.randperm(num_slots, generator=gen)[:len(rows)]
    cu = torch.tensor([0] + [n for n, _ in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
    return slots, cu, torch.tensor([c for _, c in rows], dtype=torch.bool)


def _case(gen, dtype, rows, conv_dim, width, state_shape, before, after):
    """The tensors of a case in one order: `before` ({name: fn(gen)}), the conv weight, bias and
    state, the recurrent state (fp32), `after`; then the rows on 2 more slots than rows."""
    num_slots = len(rows) + 2
    t = {k: f(gen) for k, f in before.items()}
    t.update(conv_weight=(torch.randn(conv_dim, width, generator=gen) * 0.5).to(dtype),
             conv_bias=torch.randn(conv_dim, generator=gen).to(dtype),
             conv_state=torch.randn(num_slots, conv_dim, width, generator=gen).to(dtype),
             state=torch.randn(num_slots, *state_shape, generator=gen) * 0.5)
    t.update({k: f(gen) for k, f in after.items()})
    return t, _rows(rows, num_slots, gen)


def make_gdn(case, dtype, seed=0, pad=0):
    nk, hv, kd, vd, width, rows = GDN_CASES[case]
    n, r = sum(length for length, _ in rows), hv // nk
    cols = nk * (2 * kd + 2 * r * vd)
    tensors, slots = _case(
        torch.Generator().manual_seed(seed), dtype, rows, 2 * nk * kd + hv * vd, width,
        (hv, kd, vd),      # qkvz's rows strided by pad
        dict(qkvz=lambda g: torch.randn(n, cols + pad, generator=g).to(dtype)[:, :cols],
             ba=lambda g: torch.randn(n, nk * 2 * r, generator=g).to(dtype)),
        dict(dt_bias=lambda g: torch.randn(hv, generator=g).to(dtype),
             neg_a=lambda g: -torch.rand(hv, generator=g) * 2,
             norm_weight=lambda g: (1 + 0.1 * torch.randn(vd, generator=g)).to(dtype)))
    kw = dict(num_k_heads=nk, num_v_heads=hv, k_dim=kd, v_dim=vd, scale=kd ** -0.5, norm_eps=1e-6)
    return tensors, slots, kw


def _call(fn, t, rows, kw, **extra):
    return fn(t["qkvz"], t["ba"], t["conv_weight"], t["conv_bias"], t["conv_state"], t["state"],
              t["dt_bias"], t["neg_a"], t["norm_weight"], *rows, **kw, **extra)


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gated_delta_net_matches_reference(case, dtype, isa):
    t, rows, kw = make_gdn(case, dtype, pad=5)
    ref_t = {k: v.clone() for k, v in t.items()}
    want = _call(ref_gated_delta_net, ref_t, rows, kw)
    got = _call(gated_delta_net, t, rows, kw, isa=isa)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(t["state"], ref_t["state"], **TOL[torch.float32])
    assert torch.equal(t["conv_state"], ref_t["conv_state"])      # the window: copies only


def test_gated_delta_net_equals_the_separate_ops():
    """fp32: the fused call is the separate kernels with the split and the gates in between
    (gates computed in torch here; exp/log1p may differ in the last bit, so within 1e-6)."""
    t, (slots, cu, has), kw = make_gdn("mixed-rows-awkward", torch.float32)
    sep = {k: v.clone() for k, v in t.items()}
    got = _call(gated_delta_net, t, (slots, cu, has), kw)
    nk, hv, kd, vd = kw["num_k_heads"], kw["num_v_heads"], kw["k_dim"], kw["v_dim"]
    n, r = sep["qkvz"].shape[0], hv // nk
    x = sep["qkvz"].reshape(n, nk, -1)
    mixed = torch.cat([x[..., :kd].reshape(n, -1), x[..., kd:2 * kd].reshape(n, -1),
                       x[..., 2 * kd:2 * kd + r * vd].reshape(n, -1)], -1)
    conv = ops.causal_conv1d(mixed, sep["conv_weight"], sep["conv_bias"], sep["conv_state"],
                             slots, cu, has, activation="silu")
    ba = sep["ba"].reshape(n, nk, 2 * r)
    beta = ba[..., :r].sigmoid().reshape(n, hv).contiguous()
    g = (F.softplus(ba[..., r:].reshape(n, hv) + sep["dt_bias"]) * sep["neg_a"]).contiguous()
    core = ops.gated_delta_rule(conv[:, :nk * kd].reshape(n, nk, kd),
                                conv[:, nk * kd:2 * nk * kd].reshape(n, nk, kd),
                                conv[:, 2 * nk * kd:].reshape(n, hv, vd), g, beta, sep["state"],
                                slots, cu, has, scale=kw["scale"])
    want = ops.gated_rms_norm(core.reshape(n, -1), x[..., 2 * kd + r * vd:].reshape(n, -1),
                              sep["norm_weight"], kw["norm_eps"], group_size=vd)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t["state"], sep["state"], rtol=1e-6, atol=1e-6)
    assert torch.equal(t["conv_state"], sep["conv_state"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_delta_net_same_at_one_and_two_threads(dtype):
    t, rows, kw = make_gdn("hd128-decode-batch", dtype)

    def run(state):
        return _call(gated_delta_net, dict(t, state=state, conv_state=t["conv_state"].clone()),
                     rows, kw)
    assert_same_at_threads(run, t["state"])


def make_mamba(case, dtype, seed=0, pad=0):
    nh, hd, ng, ds, norm_groups, width, rows = MAMBA_CASES[case]
    n, inner = sum(length for length, _ in rows), nh * hd
    conv_dim = inner + 2 * ng * ds
    cols = inner + conv_dim + nh
    tensors, slots = _case(
        torch.Generator().manual_seed(seed), dtype, rows, conv_dim, width, (nh, hd, ds),
        dict(proj=lambda g: torch.randn(n, cols + pad, generator=g).to(dtype)[:, :cols]),
        dict(A=lambda g: -torch.rand(nh, generator=g) * 2, D=lambda g: torch.randn(nh, generator=g),
             dt_bias=lambda g: torch.randn(nh, generator=g) * 0.5,
             norm_weight=lambda g: (1 + 0.1 * torch.randn(inner, generator=g)).to(dtype)))
    kw = dict(num_heads=nh, head_dim=hd, num_groups=ng, d_state=ds,
              norm_group_size=inner // norm_groups, norm_eps=1e-6)
    return tensors, slots, kw


def _call_mamba(fn, t, rows, kw, **extra):
    return fn(t["proj"], t["conv_weight"], t["conv_bias"], t["conv_state"], t["state"], t["A"],
              t["D"], t["dt_bias"], t["norm_weight"], *rows, **kw, **extra)


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MAMBA_CASES))
def test_mamba2_mixer_matches_reference(case, dtype, isa):
    t, rows, kw = make_mamba(case, dtype, pad=3)
    ref_t = {k: v.clone() for k, v in t.items()}
    want = _call_mamba(ref_mamba2_mixer, ref_t, rows, kw)
    got = _call_mamba(mamba2_mixer, t, rows, kw, isa=isa)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(t["state"], ref_t["state"], **TOL[torch.float32])
    assert torch.equal(t["conv_state"], ref_t["conv_state"])


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mamba2_mixer_is_the_separate_ops_bit_for_bit(dtype, isa):
    t, (slots, cu, has), kw = make_mamba("mixed-rows-groups", dtype, pad=3)
    sep = {k: v.clone() for k, v in t.items()}
    got = _call_mamba(mamba2_mixer, t, (slots, cu, has), kw, isa=isa)
    nh, hd, ng, ds = kw["num_heads"], kw["head_dim"], kw["num_groups"], kw["d_state"]
    inner, bc, n = nh * hd, ng * ds, sep["proj"].shape[0]
    gate, xbc, dt = sep["proj"].split([inner, inner + 2 * bc, nh], dim=-1)
    conv = ops.causal_conv1d(xbc, sep["conv_weight"], sep["conv_bias"], sep["conv_state"], slots,
                             cu, has, activation="silu", isa=isa)
    y = ops.selective_scan(conv[:, :inner].view(n, nh, hd), dt.float().contiguous(), sep["A"],
                           conv[:, inner:inner + bc].view(n, ng, ds),
                           conv[:, inner + bc:].view(n, ng, ds), sep["state"], slots, cu, has,
                           D=sep["D"], dt_bias=sep["dt_bias"], isa=isa)
    want = ops.gated_rms_norm(y.view(n, inner), gate, sep["norm_weight"], kw["norm_eps"],
                              group_size=kw["norm_group_size"], norm_before_gate=False, isa=isa)
    assert torch.equal(got, want)
    assert torch.equal(t["state"], sep["state"]) and torch.equal(t["conv_state"], sep["conv_state"])


def test_mamba2_mixer_same_at_one_and_two_threads():
    t, rows, kw = make_mamba("ds128-decode-batch", torch.bfloat16)

    def run(state):
        return _call_mamba(mamba2_mixer, dict(t, state=state, conv_state=t["conv_state"].clone()),
                           rows, kw)
    assert_same_at_threads(run, t["state"])


def test_bad_inputs_name_the_argument():
    t, rows, kw = make_gdn("decode-one-row", torch.float32)
    with pytest.raises(ValueError, match="qkvz must have"):
        _call(gated_delta_net, dict(t, qkvz=t["qkvz"][:, :-1]), rows, kw)
    with pytest.raises(ValueError, match="ba must be"):
        _call(gated_delta_net, dict(t, ba=t["ba"][:, :1]), rows, kw)
    with pytest.raises(TypeError, match="dt_bias"):
        _call(gated_delta_net, dict(t, dt_bias=t["dt_bias"].double()), rows, kw)
    with pytest.raises(ValueError, match="num_v_heads"):
        _call(gated_delta_net, t, rows, dict(kw, num_v_heads=3, num_k_heads=2))
    with pytest.raises(TypeError, match="qkvz must be a float32 or bfloat16"):
        _call(gated_delta_net, dict(t, qkvz=t["qkvz"].half()), rows, kw)
    with pytest.raises(ValueError, match="conv_weight must have shape .* width <= 16"):
        _call(gated_delta_net, dict(t, conv_weight=t["conv_weight"].repeat(1, 5)), rows, kw)
    with pytest.raises(ValueError, match="conv_bias must have shape"):
        _call(gated_delta_net, dict(t, conv_bias=t["conv_bias"][1:]), rows, kw)
    m, mrows, mkw = make_mamba("decode-one-row", torch.float32)
    with pytest.raises(ValueError, match="proj must have"):
        _call_mamba(mamba2_mixer, dict(m, proj=m["proj"][:, 1:]), mrows, mkw)
    with pytest.raises(ValueError, match="norm_group_size"):
        _call_mamba(mamba2_mixer, m, mrows, dict(mkw, norm_group_size=5))
    with pytest.raises(ValueError, match="slots must lie"):
        _call_mamba(mamba2_mixer, m, (mrows[0] + 10, *mrows[1:]), mkw)


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("x_dtype,dtype", [(torch.float32, torch.float32),
                                           (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-residual-fp32", "bf16"])
def test_mamba2_block_is_the_separate_calls_bit_for_bit(x_dtype, dtype, isa):
    """The whole block in C++ against the engine's calls before it: the norm on x rounded to
    the dtype, the packed in_proj, the mixer, the packed out_proj, the residual add in x's
    dtype."""
    from cb_kernels.ops.fused_hybrid import mamba2_block_unchecked
    from cb_kernels.ops.linear import PackedLinear

    t, (slots, cu, has), kw = make_mamba("mixed-rows-groups", dtype)
    gen = torch.Generator().manual_seed(5)
    n, hidden, width = t["proj"].shape[0], 40, t["proj"].shape[1]
    inner = kw["num_heads"] * kw["head_dim"]
    in_proj = PackedLinear((torch.randn(width, hidden, generator=gen) * 0.2).to(dtype))
    out_proj = PackedLinear((torch.randn(hidden, inner, generator=gen) * 0.2).to(dtype),
                            torch.randn(hidden, generator=gen).to(dtype))
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x = torch.randn(n, hidden, generator=gen).to(x_dtype)
    sep = {k: v.clone() for k, v in t.items()}
    want_x = x.clone()
    h = ops.rms_norm(want_x.to(dtype), norm_w, 1e-5)
    y = mamba2_mixer(in_proj.run_unchecked(h), sep["conv_weight"], sep["conv_bias"],
                     sep["conv_state"], sep["state"], sep["A"], sep["D"], sep["dt_bias"],
                     sep["norm_weight"], slots, cu, has, **kw, isa=isa)
    want_x += out_proj.run_unchecked(y)
    got_x = x.clone()
    mamba2_block_unchecked(got_x, norm_w, 1e-5, in_proj, out_proj, t["conv_weight"],
                           t["conv_bias"], t["conv_state"], t["state"], t["A"], t["D"],
                           t["dt_bias"], t["norm_weight"], slots, cu, has, kw["num_heads"],
                           kw["head_dim"], kw["num_groups"], kw["d_state"],
                           kw["norm_group_size"], kw["norm_eps"], isa=isa)
    assert torch.equal(got_x, want_x)
    assert torch.equal(t["state"], sep["state"]) and torch.equal(t["conv_state"], sep["conv_state"])


def test_registered_ops_match_the_calls():
    """torch.ops.cb_kernels.gated_delta_net / mamba2_mixer (for torch.compile) run the same
    kernels: the same bits as the direct calls, the slots mutated the same way."""
    t, rows, kw = make_gdn("mixed-rows-awkward", torch.bfloat16)
    a = {k: v.clone() for k, v in t.items()}
    want = _call(ops.gated_delta_net, t, rows, kw)
    got = torch.ops.cb_kernels.gated_delta_net(
        a["qkvz"], a["ba"], a["conv_weight"], a["conv_bias"], a["conv_state"], a["state"],
        a["dt_bias"], a["neg_a"], a["norm_weight"], *rows, kw["num_k_heads"], kw["num_v_heads"],
        kw["k_dim"], kw["v_dim"], kw["scale"], kw["norm_eps"])
    assert torch.equal(got, want) and torch.equal(a["state"], t["state"])
    m, mrows, mkw = make_mamba("mixed-rows-groups", torch.float32)
    b = {k: v.clone() for k, v in m.items()}
    want = _call_mamba(ops.mamba2_mixer, m, mrows, mkw)
    got = torch.ops.cb_kernels.mamba2_mixer(
        b["proj"], b["conv_weight"], b["conv_bias"], b["conv_state"], b["state"], b["A"], b["D"],
        b["dt_bias"], b["norm_weight"], *mrows, mkw["num_heads"], mkw["head_dim"],
        mkw["num_groups"], mkw["d_state"], mkw["norm_group_size"], mkw["norm_eps"])
    assert torch.equal(got, want) and torch.equal(b["conv_state"], m["conv_state"])


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_pending", [True, False], ids=["pending", "first-layer"])
def test_gated_delta_net_block_is_the_separate_calls_bit_for_bit(dtype, isa, with_pending):
    """Qwen3-Next's layer up to its MLP in C++ against the engine's calls before it: the
    (1 + w) norm with the pending residual, the packed qkvz / ba projections, the fused middle,
    the packed out_proj, the post norm with its residual add."""
    from cb_kernels.ops.fused_hybrid import gated_delta_net_block_unchecked
    from cb_kernels.ops.linear import PackedLinear
    from cb_kernels.ops.offset_rms_norm import offset_rms_norm_unchecked

    t, (slots, cu, has), kw = make_gdn("mixed-rows-awkward", dtype)
    gen = torch.Generator().manual_seed(6)
    n, hidden = t["qkvz"].shape[0], 48
    nk, hv, vd = kw["num_k_heads"], kw["num_v_heads"], kw["v_dim"]
    lin = [PackedLinear((torch.randn(o, i, generator=gen) * 0.2).to(dtype))
           for o, i in ((t["qkvz"].shape[1], hidden), (t["ba"].shape[1], hidden),
                        (hidden, hv * vd))]
    w_in, w_post = [(0.1 * torch.randn(hidden, generator=gen)).to(dtype) for _ in range(2)]
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    pending = torch.randn(n, hidden, generator=gen).to(dtype) if with_pending else None
    sep = {k: v.clone() for k, v in t.items()}
    want_x = x.clone()
    h = offset_rms_norm_unchecked(want_x, w_in, 1e-6, pending)
    normed = gated_delta_net(lin[0].run_unchecked(h), lin[1].run_unchecked(h),
                             sep["conv_weight"], sep["conv_bias"], sep["conv_state"],
                             sep["state"], sep["dt_bias"], sep["neg_a"], sep["norm_weight"],
                             slots, cu, has, **kw, isa=isa)
    want_h = offset_rms_norm_unchecked(want_x, w_post, 1e-6, lin[2].run_unchecked(normed))
    got_x = x.clone()
    got_h = gated_delta_net_block_unchecked(
        got_x, pending, w_in, 1e-6, w_post, 1e-6, *lin, t["conv_weight"], t["conv_bias"],
        t["conv_state"], t["state"], t["dt_bias"], t["neg_a"], t["norm_weight"], slots, cu, has,
        nk, hv, kw["k_dim"], vd, kw["scale"], kw["norm_eps"], isa=isa)
    assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h)
    assert torch.equal(t["state"], sep["state"]) and torch.equal(t["conv_state"], sep["conv_state"])
