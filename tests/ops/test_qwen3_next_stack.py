"""ops.Qwen3NextStack (csrc/cpu/qwen3_next_stack.cpp): a Qwen3-Next backbone in one call against
the calls it replaces (the embedding, per layer `gated_delta_net_block_unchecked` or
`gated_attention_block_unchecked` then `moe_block_unchecked`, the final norm with the last
MLP's output, the sampled rows' selection), bit for bit: the output, every state slot and KV
cache; bf16 with attention layers, fp32 with delta-net layers only; MoE and dense MLPs;
decodes, fresh prefills and continued chunks in one call; wrong inputs named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_kernels import _C
from cb_kernels.ops.fused_hybrid import gated_delta_net_block_unchecked
from cb_kernels.ops.gated_attention import gated_attention_block_unchecked
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.moe import PackedExperts
from cb_kernels.ops.moe_block import moe_block_unchecked
from cb_kernels.ops.offset_rms_norm import offset_rms_norm_unchecked
from cb_kernels.ops.qwen3_next_stack import (Qwen3NextAttentionLayer, Qwen3NextDeltaNetLayer,
                                             Qwen3NextMlp, Qwen3NextStack)
from tests.ops.test_gated_attention import paged_sequences

pytestmark = pytest.mark.one_thread

HIDDEN, VOCAB, EPS = 48, 50, 1e-6
# gated delta-net: num_k_heads, num_v_heads, k_dim, v_dim, conv width
GDN = (2, 4, 16, 12, 4)
# attention: num_heads, num_kv_heads, head_dim, rotary_dim, block_size
ATTN = (4, 2, 16, 8, 4)
# MLP: shared / dense inter, num_experts, experts' inter, top_k
MLP = (24, 4, 20, 2)
# id: [(q tokens, positions before them)] per sequence (0 before: a fresh prefill)
STEPS = {
    "decode-16": [(1, 3 + 2 * i) for i in range(16)],
    "mixed-rows": [(1, 5), (6, 0), (1, 9), (3, 4)],
    "one-prefill": [(7, 0)],
}
# id: (dtype, layer kinds ("gdn", "attn") with their MLP ("moe", "dense"))
MODELS = {
    "bf16-hybrid": (torch.bfloat16, [("gdn", "moe"), ("attn", "moe"), ("gdn", "dense"),
                                     ("attn", "dense")]),
    "fp32-delta-nets": (torch.float32, [("gdn", "moe"), ("gdn", "dense")]),
    "bf16-delta-nets": (torch.bfloat16, [("gdn", "dense"), ("gdn", "moe")]),
}


def _rnd(g, dtype, *shape, s=1.0):
    return (torch.randn(*shape, generator=g) * s).to(dtype)


def _mlp(g, dtype, kind):
    inter, num_experts, e_inter, top_k = MLP
    gate_up = PackedLinear(_rnd(g, dtype, 2 * inter, HIDDEN, s=HIDDEN ** -0.5))
    down = PackedLinear(_rnd(g, dtype, HIDDEN, inter, s=inter ** -0.5))
    if kind == "dense":
        return Qwen3NextMlp(gate_up, down)
    return Qwen3NextMlp(gate_up, down, PackedLinear(_rnd(g, dtype, 1, HIDDEN)),
                        PackedLinear(_rnd(g, dtype, num_experts, HIDDEN)), top_k, True,
                        PackedExperts(_rnd(g, dtype, num_experts, 2 * e_inter, HIDDEN,
                                           s=HIDDEN ** -0.5),
                                      _rnd(g, dtype, num_experts, HIDDEN, e_inter,
                                           s=e_inter ** -0.5)))


def _gdn(g, dtype, mlp, num_slots):
    nk, nv, kd, vd, width = GDN
    r, conv_dim = nv // nk, 2 * nk * kd + nv * vd
    return Qwen3NextDeltaNetLayer(
        _rnd(g, dtype, HIDDEN, s=0.1), _rnd(g, dtype, HIDDEN, s=0.1), (EPS, 2 * EPS, 1e-5),
        PackedLinear(_rnd(g, dtype, nk * (2 * kd + 2 * r * vd), HIDDEN, s=0.2)),
        PackedLinear(_rnd(g, dtype, nk * 2 * r, HIDDEN, s=0.2)),
        PackedLinear(_rnd(g, dtype, HIDDEN, nv * vd, s=0.2), _rnd(g, dtype, HIDDEN)),
        _rnd(g, dtype, conv_dim, width, s=0.5), _rnd(g, dtype, conv_dim),
        _rnd(g, dtype, num_slots, conv_dim, width), torch.randn(num_slots, nv, kd, vd,
                                                               generator=g) * 0.5,
        _rnd(g, dtype, nv), -torch.rand(nv, generator=g) * 2,
        (1 + 0.1 * torch.randn(vd, generator=g)).to(dtype), nk, nv, kd, vd, kd ** -0.5, mlp)


def _attn(g, dtype, mlp, num_blocks):
    heads, kv, hd, _, bs = ATTN
    return Qwen3NextAttentionLayer(
        _rnd(g, dtype, HIDDEN, s=0.1), _rnd(g, dtype, HIDDEN, s=0.1), _rnd(g, dtype, hd, s=0.1),
        _rnd(g, dtype, hd, s=0.1), (EPS, 2 * EPS, 3 * EPS, 4 * EPS),
        PackedLinear(_rnd(g, dtype, (2 * heads + 2 * kv) * hd, HIDDEN, s=HIDDEN ** -0.5)),
        PackedLinear(_rnd(g, dtype, HIDDEN, heads * hd, s=0.05)),
        _rnd(g, dtype, num_blocks, bs, kv, hd), _rnd(g, dtype, num_blocks, bs, kv, hd), heads,
        0.2, mlp)


def make(model, step, seed=0):
    """(stack arguments, per-step arguments): the model's layers with their own weights, state
    slots (2 more than the rows) and caches; the step's ids, sampled rows (each row's last
    token), varlen rows, cos / sin and attention metadata."""
    dtype, kinds = MODELS[model]
    seqs = STEPS[step]
    g = torch.Generator().manual_seed(seed)
    rd, num_slots = ATTN[3], len(seqs) + 2
    tables, slot_mapping, positions, num_blocks = paged_sequences(seqs, ATTN[4], g)
    layers = [(_gdn(g, dtype, _mlp(g, dtype, m), num_slots) if k == "gdn" else
               _attn(g, dtype, _mlp(g, dtype, m), num_blocks)) for k, m in kinds]
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    emb = torch.cat([torch.tensor(positions).float()[:, None] * inv] * 2, dim=-1)
    cu = torch.tensor([0] + [q for q, _ in seqs]).cumsum(0).to(torch.int32)
    n = int(cu[-1])
    step_args = dict(
        input_ids=torch.randint(0, VOCAB, (n,), generator=g),
        logits_indices=(cu[1:] - 1).long(),
        slots=torch.randperm(num_slots, generator=g)[:len(seqs)].contiguous(), cu_seqlens=cu,
        has_state=torch.tensor([c > 0 for _, c in seqs]),
        cos=emb.cos().to(dtype).contiguous(), sin=emb.sin().to(dtype).contiguous(),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64), block_tables=tables,
        seq_lens=torch.tensor([q + c for q, c in seqs], dtype=torch.int32), cu_seqlens_q=cu)
    args = (_rnd(g, dtype, VOCAB, HIDDEN), layers, _rnd(g, dtype, HIDDEN, s=0.1), EPS)
    return args, step_args


def _clone_layers(layers):
    return [l._replace(conv_state=l.conv_state.clone(), state=l.state.clone())
            if isinstance(l, Qwen3NextDeltaNetLayer) else
            l._replace(k_cache=l.k_cache.clone(), v_cache=l.v_cache.clone()) for l in layers]


def _mlp_call(h, m: Qwen3NextMlp, isa):
    return moe_block_unchecked(h, m.gate_up, m.down, m.shared_gate, m.router, m.top_k,
                               m.renormalize, m.experts, isa)


def separate_calls(args, s, isa="auto"):
    """What runner/hybrid_layers.py's per-layer path runs: two calls a layer."""
    embed, layers, final, eps = args
    x, pending = F.embedding(s["input_ids"], embed), None
    rows = (s["slots"], s["cu_seqlens"], s["has_state"])
    for l in layers:
        if isinstance(l, Qwen3NextDeltaNetLayer):
            h = gated_delta_net_block_unchecked(
                x, pending, l.in_norm_weight, l.norm_eps[0], l.post_norm_weight, l.norm_eps[1],
                l.qkvz_proj, l.ba_proj, l.out_proj, l.conv_weight, l.conv_bias, l.conv_state,
                l.state, l.dt_bias, l.neg_a, l.gate_norm_weight, *rows, l.num_k_heads,
                l.num_v_heads, l.k_dim, l.v_dim, l.scale, l.norm_eps[2], isa=isa)
        else:
            h = gated_attention_block_unchecked(
                x, pending, l.in_norm_weight, l.post_norm_weight, l.qkv_proj.packed,
                l.qkv_proj.bias, l.o_proj.packed, l.o_proj.bias, l.q_norm_weight,
                l.k_norm_weight, s["cos"], s["sin"], l.k_cache, l.v_cache, s["slot_mapping"],
                s["block_tables"], s["seq_lens"], s["cu_seqlens_q"], l.num_heads, l.norm_eps,
                l.scale, isa)
        pending = _mlp_call(h, l.mlp, isa)
    return offset_rms_norm_unchecked(x, final, eps, pending).index_select(0, s["logits_indices"])


def _stack(args):
    return Qwen3NextStack(*args, rotary_dim=ATTN[3])


def _assert_same_state(a, b):
    for la, lb in zip(a, b):
        names = ("conv_state", "state") if isinstance(la, Qwen3NextDeltaNetLayer) else \
            ("k_cache", "v_cache")
        for name in names:
            assert torch.equal(getattr(la, name), getattr(lb, name)), name


@pytest.mark.parametrize("isa", ["auto", "portable"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("model", list(MODELS))
def test_stack_is_the_separate_calls_bit_for_bit(model, step, isa):
    args, s = make(model, step)
    sep = _clone_layers(args[1])
    want = separate_calls((args[0], sep, *args[2:]), s, isa)
    got = _stack(args)(**s, isa=isa)
    assert got.dtype == args[0].dtype and got.shape == (s["logits_indices"].shape[0], HIDDEN)
    assert torch.equal(got, want)
    _assert_same_state(args[1], sep)


def test_steps_in_a_row_reuse_the_workspace_and_match():
    """Two steps on one stack (the second decodes after the first's prefills, a larger
    workspace first): each equals the separate calls on the states as they are then."""
    args, s = make("bf16-hybrid", "mixed-rows", seed=3)
    sep = _clone_layers(args[1])
    stack = _stack(args)
    for _ in range(2):
        want = separate_calls((args[0], sep, *args[2:]), s)
        assert torch.equal(stack(**s), want)
        _assert_same_state(args[1], sep)
        s["has_state"] = torch.ones_like(s["has_state"])


def test_no_sampled_rows_still_updates_the_state():
    args, s = make("bf16-hybrid", "mixed-rows", seed=4)
    sep = _clone_layers(args[1])
    separate_calls((args[0], sep, *args[2:]), s)
    s["logits_indices"] = torch.empty(0, dtype=torch.int64)
    out = _stack(args)(**s)
    assert out.shape == (0, HIDDEN)
    _assert_same_state(args[1], sep)


def test_fp32_attention_layers_are_refused():
    args, _ = make("bf16-hybrid", "decode-16")
    g = torch.Generator().manual_seed(1)
    layer = _attn(g, torch.float32, _mlp(g, torch.float32, "dense"), 8)
    with pytest.raises(ValueError, match=r"layers\[0\]: an attention layer needs bfloat16"):
        Qwen3NextStack(args[0].float(), [layer], args[2].float(), EPS, rotary_dim=ATTN[3])


def _bad_layer(args, index, **change):
    layers = list(args[1])
    layers[index] = layers[index]._replace(**change)
    return (args[0], layers, *args[2:])


def test_bad_layers_name_the_layer_and_argument():
    args, _ = make("bf16-hybrid", "decode-16")
    dt = args[0].dtype
    cases = [
        (_bad_layer(args, 0, in_norm_weight=torch.zeros(HIDDEN + 1, dtype=dt)),
         r"layers\[0\]: in_norm_weight must be \[48\]"),
        (_bad_layer(args, 2, qkvz_proj=args[1][2].ba_proj), r"layers\[2\]: qkvz_proj must be"),
        (_bad_layer(args, 0, state=args[1][0].state[:, :1].contiguous()),
         r"layers\[0\]: state must be"),
        (_bad_layer(args, 1, q_norm_weight=torch.zeros(3, dtype=dt)),
         r"layers\[1\]: q_norm_weight must be"),
        (_bad_layer(args, 3, k_cache=args[1][3].k_cache.float()), r"layers\[3\]: k_cache"),
        (_bad_layer(args, 1, mlp=args[1][1].mlp._replace(top_k=9)), r"layers\[1\]: top_k"),
        ((args[0], list(args[1]) + ["a layer"], *args[2:]), r"layers\[4\] must be a"),
        ((args[0], args[1], args[2][:5], EPS), "final_norm_weight must be"),
    ]
    for bad, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            _stack(bad)


def test_bad_step_inputs_name_the_argument():
    args, s = make("bf16-hybrid", "mixed-rows")
    stack = _stack(args)
    n = s["input_ids"].shape[0]
    cases = [
        (dict(input_ids=s["input_ids"].int()), "input_ids must have dtype"),
        (dict(input_ids=s["input_ids"] + VOCAB), r"input_ids must lie in \[0, 50\)"),
        (dict(logits_indices=s["logits_indices"] + n), "logits_indices must lie in"),
        (dict(slots=s["slots"] + 10), "slots must lie in"),
        (dict(cu_seqlens=s["cu_seqlens"] * 2), "cu_seqlens must start at 0, end at"),
        (dict(cos=s["cos"][:, :4].contiguous()), "cos must be"),
        (dict(sin=s["sin"].float()), "sin must have dtype"),
        (dict(slot_mapping=s["slot_mapping"][:-1].contiguous()), "slot_mapping must have"),
        (dict(seq_lens=s["seq_lens"][:1].contiguous()), "seq_lens must have"),
    ]
    for change, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            stack(**{**s, **change})
    with pytest.raises(ValueError, match="isa"):
        stack(**s, isa="nope")


def test_unchecked_run_refuses_ids_out_of_range_in_cpp():
    args, s = make("bf16-delta-nets", "decode-16")
    stack = _stack(args)
    s["input_ids"] = s["input_ids"] + VOCAB
    with pytest.raises(RuntimeError, match="an input id outside"):
        stack.run_unchecked(*s.values())
    assert "Qwen3NextStack" in dir(_C)
