"""ops.Mamba2Stack (csrc/cpu/mamba2_stack.cpp): a Mamba-2 backbone in one call against the calls
it replaces (the embedding, `mamba2_block_unchecked` per layer, the final norm on the residual
stream, the cast, the sampled rows' selection), bit for bit: fp32, bf16 with and without the
fp32 residual stream, decodes, fresh prefills, continued chunks and an empty row in one call,
every CPU body forced, 1 and 2 threads; wrong inputs named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cb_kernels import _C, ops
from cb_kernels.ops.fused_hybrid import mamba2_block_unchecked
from cb_kernels.ops.mamba2_stack import Mamba2Stack, Mamba2StackLayer
from tests.ops.test_fused_hybrid import make_mamba

_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]
HIDDEN, VOCAB = 40, 50
# id: (the stream's dtype, the layers' dtype)
DTYPES = {"fp32": (torch.float32, torch.float32),
          "bf16-residual-fp32": (torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, torch.bfloat16)}


def make_stack(dtypes, num_layers=3, case="mixed-rows-groups", seed=0):
    """(stack arguments, rows, input_ids, logits_indices): num_layers layers of make_mamba's
    case, each with its own weights and state slots."""
    x_dtype, dtype = dtypes
    gen = torch.Generator().manual_seed(seed + 100)
    layers = []
    for i in range(num_layers):
        t, rows, kw = make_mamba(case, dtype, seed=seed + i)
        width, inner = t["proj"].shape[1], kw["num_heads"] * kw["head_dim"]
        layers.append(Mamba2StackLayer(
            (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype), 1e-5,
            ops.PackedLinear((torch.randn(width, HIDDEN, generator=gen) * 0.2).to(dtype)),
            ops.PackedLinear((torch.randn(HIDDEN, inner, generator=gen) * 0.2).to(dtype),
                             torch.randn(HIDDEN, generator=gen).to(dtype)),
            t["conv_weight"], t["conv_bias"], t["conv_state"], t["state"], t["A"], t["D"],
            t["dt_bias"], t["norm_weight"], kw["norm_eps"], kw["num_heads"], kw["head_dim"],
            kw["num_groups"], kw["d_state"], kw["norm_group_size"]))
    embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)
    final = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype).to(x_dtype)
    n = int(rows[1][-1])
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    last = rows[1][1:].long() - 1          # each row's last token; an empty row samples none
    idx = last[rows[1][1:] > rows[1][:-1]].contiguous()
    return (embed, layers, final, 1e-5), rows, ids, idx


def _clone_states(layers):
    return [l._replace(conv_state=l.conv_state.clone(), state=l.state.clone()) for l in layers]


def separate_calls(args, rows, ids, idx, x_dtype, isa="auto"):
    """What runner/hybrid_layers.py ran before the stack: one block call a layer."""
    embed, layers, final, eps = args
    x = F.embedding(ids, embed).to(x_dtype)
    for l in layers:
        mamba2_block_unchecked(x, l.norm_weight, l.norm_eps, l.in_proj, l.out_proj,
                               l.conv_weight, l.conv_bias, l.conv_state, l.state, l.A, l.D,
                               l.dt_bias, l.gate_norm_weight, *rows, l.num_heads, l.head_dim,
                               l.num_groups, l.d_state, l.norm_group_size, l.gate_norm_eps,
                               isa=isa)
    return ops.rms_norm_unchecked(x, final, eps).to(embed.dtype).index_select(0, idx)


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("case", ["mixed-rows-groups", "ds128-decode-batch"])
def test_stack_is_the_separate_calls_bit_for_bit(case, dtypes, isa):
    x_dtype, dtype = DTYPES[dtypes]
    args, rows, ids, idx = make_stack(DTYPES[dtypes], case=case)
    sep = _clone_states(args[1])
    want = separate_calls((args[0], sep, *args[2:]), rows, ids, idx, x_dtype, isa=isa)
    stack = Mamba2Stack(*args, residual_fp32=x_dtype == torch.float32)
    got = stack(ids, idx, *rows, isa=isa)
    assert got.dtype == dtype and got.shape == (idx.shape[0], HIDDEN)
    assert torch.equal(got, want)
    for a, b in zip(args[1], sep):
        assert torch.equal(a.state, b.state) and torch.equal(a.conv_state, b.conv_state)


def test_stack_steps_reuse_its_workspace_and_continue_the_states():
    """A prefill step, then a decode step of fewer tokens on the same stack (its workspace
    kept): each the separate calls' bits, the slots carried from one step to the next."""
    args, rows, ids, idx = make_stack(DTYPES["bf16-residual-fp32"])
    sep = _clone_states(args[1])
    stack = Mamba2Stack(*args, residual_fp32=True)
    slots = rows[0]
    decode = (slots, torch.arange(slots.shape[0] + 1, dtype=torch.int32),
              torch.ones(slots.shape[0], dtype=torch.bool))
    decode_ids = torch.randint(0, VOCAB, (slots.shape[0],),
                               generator=torch.Generator().manual_seed(3))
    all_rows = torch.arange(slots.shape[0])
    for r, i, x in ((rows, ids, idx), (decode, decode_ids, all_rows)):
        want = separate_calls((args[0], sep, *args[2:]), r, i, x, torch.float32)
        assert torch.equal(stack(i, x, *r), want)


@pytest.mark.parametrize("dtypes", ["bf16-residual-fp32", "bf16"])
def test_stack_same_at_one_and_two_threads(dtypes):
    args, rows, ids, idx = make_stack(DTYPES[dtypes], case="ds128-decode-batch")
    saved, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            layers = _clone_states(args[1])
            stack = Mamba2Stack(args[0], layers, *args[2:],
                                residual_fp32=DTYPES[dtypes][0] == torch.float32)
            outs.append((stack(ids, idx, *rows), layers))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.equal(a.state, b.state) and torch.equal(a.conv_state, b.conv_state)


def test_bad_inputs_name_the_argument():
    (embed, layers, final, eps), rows, ids, idx = make_stack(DTYPES["fp32"], num_layers=2)
    with pytest.raises(TypeError, match="embed must be a float32 or bfloat16"):
        Mamba2Stack(embed.double(), layers, final, eps, residual_fp32=True)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        Mamba2Stack(embed, [], final, eps, residual_fp32=True)
    bad = layers[1]._replace(in_proj=layers[1].out_proj)
    with pytest.raises(ValueError, match=r"layers\[1\]\.in_proj must be"):
        Mamba2Stack(embed, [layers[0], bad], final, eps, residual_fp32=True)
    bad = layers[1]._replace(state=layers[1].state[:-1].contiguous())
    with pytest.raises(ValueError, match=r"layers\[1\]\.state must be"):
        Mamba2Stack(embed, [layers[0], bad], final, eps, residual_fp32=True)
    bad = layers[0]._replace(num_groups=4)
    with pytest.raises(ValueError, match=r"layers\[0\]\.num_heads"):
        Mamba2Stack(embed, [bad], final, eps, residual_fp32=True)
    with pytest.raises(ValueError, match="final_norm_weight must have 40"):
        Mamba2Stack(embed, layers, final[:-1], eps, residual_fp32=True)
    with pytest.raises(TypeError, match="final_norm_weight must have dtype"):
        Mamba2Stack(embed, layers, final.bfloat16(), eps, residual_fp32=True)
    stack = Mamba2Stack(embed, layers, final, eps, residual_fp32=True)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 50\)"):
        stack(torch.full_like(ids, VOCAB), idx, *rows)
    with pytest.raises(ValueError, match="logits_indices must lie"):
        stack(ids, idx + ids.shape[0], *rows)
    with pytest.raises(TypeError, match="input_ids must have dtype torch.int64"):
        stack(ids.int(), idx, *rows)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, end at num_tokens"):
        stack(ids[:-1].contiguous(), idx[:1], *rows)
