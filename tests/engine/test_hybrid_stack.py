"""runner/hybrid_stack.py: the engine's Mamba-2 steps as one ops.Mamba2Stack call, its bf16
Qwen3-Next steps as one ops.Qwen3NextStack call.

Tiny random models: every step runs on the stack and gives generate's greedy tokens (fp32) in
mixed batches with chunked prefills; bf16 steps give the per-layer calls' bits (their logprobs
equal); switched off, the per-layer calls run, logged; weights written in place, a Parameter
replaced, a state dict loaded with assign=True and the state pool re-pointed by sleep / wake_up
are followed (the stack rebuilt). fp32 Qwen3-Next keeps the per-layer calls (its attention
layers' gate is torch's sigmoid between two calls), logged."""
from __future__ import annotations

import logging

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.ops.mamba2_stack import Mamba2Stack
from cb_kernels.ops.qwen3_next_stack import Qwen3NextStack
from cb_kernels.runner import hybrid_kernels, hybrid_stack
from tests.model_sweep import VOCAB, generate_tokens, tiny_model

pytestmark = pytest.mark.one_thread

CASES = {"residual-fp32": {}, "residual-in-dtype": dict(residual_in_fp32=False)}


def _model(case, seed=3):
    torch.manual_seed(0)
    return tiny_model("mamba2", seed=seed, **CASES[case])


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model):
    return Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8,
                                      max_num_seqs=4))


def _run(engine, prompts, max_new, **kw):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kw)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        engine.check_invariants()
    return [outs[i] for i in ids]


def _count_stack_calls(monkeypatch, cls=Mamba2Stack) -> list:
    calls, real = [], cls.run_unchecked
    monkeypatch.setattr(cls, "run_unchecked", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_is_one_stack_call_with_generates_tokens(case, monkeypatch):
    model = _model(case)
    engine = _engine(model)
    calls = _count_stack_calls(monkeypatch)
    ps = _prompts([1, 5, 13, 22], seed=1)       # prefill chunks beside decodes (budget 8)
    got = [o.token_ids for o in _run(engine, ps, 6)]
    assert got == generate_tokens(model, ps, 6)
    assert len(calls) == engine.stats()["steps"]


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_steps_are_the_per_layer_calls_bits(case, monkeypatch):
    """bf16: the stack on and off give the same tokens and the same logprobs to the bit (the
    rows the LM head reads are equal), mixed prefill and decode steps."""
    model = _model(case).to(torch.bfloat16)
    ps = _prompts([3, 11, 6], seed=2)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(hybrid_stack, "STACK", on)
        calls = _count_stack_calls(monkeypatch)
        runs.append(_run(_engine(model), ps, 5, logprobs=3))
        assert bool(calls) == on
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("off", ["STACK", "FUSED"])
def test_switched_off_runs_the_layers_logged(off, monkeypatch, caplog):
    model = _model("residual-fp32")
    ps = _prompts([7, 2, 10], seed=11)
    want = generate_tokens(model, ps, 5)
    owner = hybrid_stack if off == "STACK" else hybrid_kernels
    monkeypatch.setattr(owner, off, False)
    calls = _count_stack_calls(monkeypatch)
    engine = _engine(model)
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        got = [o.token_ids for o in _run(engine, ps, 5)]
    assert got == want and not calls
    assert "hybrid forward: Mamba-2 layers one call each (hybrid_stack.STACK or " \
        "hybrid_kernels.FUSED is off)" in caplog.text


def test_follows_weights_written_replaced_and_a_moved_pool(monkeypatch):
    """After steps on the stack: a mixer's A_log and conv weight written in place, a block
    norm's Parameter replaced, the state pool re-pointed by sleep / wake_up: the next steps
    give generate's tokens of the model as it is then, on a rebuilt stack."""
    model = _model("residual-fp32")
    engine = _engine(model)
    ps = _prompts([6, 9], seed=7)
    _run(engine, ps, 2)
    first = engine.runner.hybrid.stack.stack
    assert first is not None
    mixer = model.backbone.layers[1].mixer
    with torch.no_grad():
        mixer.A_log.add_(0.3)
        mixer.conv1d.weight.mul_(-1.2)
    norm = model.backbone.layers[0].norm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 0.5 + 0.1)
    calls = _count_stack_calls(monkeypatch)
    assert [o.token_ids for o in _run(engine, ps, 4)] == generate_tokens(model, ps, 4)
    second = engine.runner.hybrid.stack.stack
    assert calls and second is not None and second is not first
    engine.sleep(level=1)
    engine.wake_up()
    assert [o.token_ids for o in _run(engine, ps, 4)] == generate_tokens(model, ps, 4)
    assert engine.runner.hybrid.stack.stack is not second


def test_bf16_greedy_steps_take_the_greedy_head(monkeypatch):
    """bf16 Mamba-2 on the engine's forward: all-greedy steps take the int8 greedy head on the
    stack's rows (transformers' decoder returns the fp32 stream's norm, so the decoder probe
    alone had turned it off), with the tokens of the bf16 logits' argmax (greedy_head off)."""
    from cb_kernels.runner import lm_head

    model = _model("residual-fp32").to(torch.bfloat16)
    ps = _prompts([4, 9, 15], seed=12)
    engine = _engine(model)
    assert isinstance(engine.runner.head, lm_head.GreedyTokensHead)
    assert engine.runner._decoder is None          # transformers' path keeps full logits
    calls, real = [], lm_head.GreedyTokensHead.tokens
    monkeypatch.setattr(lm_head.GreedyTokensHead, "tokens",
                        lambda *a: calls.append(1) or real(*a))
    got = [o.token_ids for o in _run(engine, ps, 6)]
    assert calls
    plain = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8,
                                       max_num_seqs=4, greedy_head=False))
    assert not isinstance(plain.runner.head, lm_head.GreedyTokensHead)
    assert got == [o.token_ids for o in _run(plain, ps, 6)]


def test_varlen_rows_of_a_decode_step():
    """A decode-only step's rows in packed order take the plan's slots tensor as it is; rows in
    another order are sorted (the general path); both give each row its slot and one token."""
    from cb_kernels.runner.hybrid_kernels import VarlenRows
    from cb_kernels.runner.state_cache import _Group

    slots = torch.tensor([7, 2, 5, 0], dtype=torch.int64)
    rows = VarlenRows([_Group(torch.arange(4), slots, True)])
    assert rows.slots is slots
    assert rows.cu_seqlens.tolist() == [0, 1, 2, 3, 4] and rows.cu_seqlens.dtype == torch.int32
    assert rows.has_state.tolist() == [True] * 4
    mixed = VarlenRows([_Group(torch.tensor([2, 0, 3, 1]), slots, True)])
    assert mixed.slots.tolist() == [2, 0, 7, 5]
    assert mixed.cu_seqlens.tolist() == [0, 1, 2, 3, 4] and mixed.has_state.all()


def test_other_state_models_whose_head_is_not_plain_keep_the_logits_head():
    """A hybrid model the engine's forward is not written for, whose logits are not its LM
    head's output (Granite's logits scaling): the logits head, no int8 copy of the head."""
    from cb_kernels.runner import lm_head

    torch.manual_seed(0)
    model = tiny_model("granitemoehybrid", seed=3)
    model.config.logits_scaling = 2.0
    engine = _engine(model)
    assert engine.runner.hybrid is None and engine.runner.state_layers
    assert type(engine.runner.head) is lm_head.LogitsHead and engine.runner._decoder is None


def _qwen3_next(dtype=torch.bfloat16, seed=3):
    """Two gated delta-net layers around an attention layer, MoE MLPs and a dense one (as
    tests/engine/test_hybrid_layers.py's)."""
    torch.manual_seed(0)
    return tiny_model("qwen3_next", seed=seed, num_hidden_layers=3, mlp_only_layers=[2],
                      layer_types=["linear_attention", "full_attention",
                                   "linear_attention"]).to(dtype)


def _logprob_run(model, ps, monkeypatch, stack_on: bool):
    """(tokens, logprobs) per prompt on a fresh Engine, the Qwen3-Next stack on or off, and
    the stack calls it made."""
    monkeypatch.setattr(hybrid_stack, "QWEN3_NEXT_STACK", stack_on)
    calls = _count_stack_calls(monkeypatch, Qwen3NextStack)
    engine = _engine(model)
    outs = _run(engine, ps, 5, logprobs=3)
    return [(o.token_ids, o.outputs[0].logprobs) for o in outs], calls, engine


def test_qwen3_next_bf16_steps_are_one_stack_call_with_the_per_layer_bits(monkeypatch):
    """Every bf16 step (decodes beside chunked prefills) is one ops.Qwen3NextStack call, with
    the tokens and logprobs of the per-layer calls to the bit."""
    model = _qwen3_next()
    ps = _prompts([4, 17, 9, 1], seed=14)
    on, calls, engine = _logprob_run(model, ps, monkeypatch, True)
    assert len(calls) == engine.stats()["steps"] > 0
    off, calls, _ = _logprob_run(model, ps, monkeypatch, False)
    assert on == off and not calls


def test_qwen3_next_fp32_keeps_the_per_layer_calls_logged(monkeypatch, caplog):
    model = _qwen3_next(torch.float32)
    ps = _prompts([7, 2, 10], seed=11)
    calls = _count_stack_calls(monkeypatch, Qwen3NextStack)
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        got = [o.token_ids for o in _run(_engine(model), ps, 5)]
    assert got == generate_tokens(model, ps, 5) and not calls
    assert "hybrid forward: Qwen3-Next layers one call each (float32 attention layers run as " \
        "two calls around torch's sigmoid)" in caplog.text


def test_qwen3_next_follows_a_loaded_state_dict_and_a_moved_pool(monkeypatch):
    """After steps on the stack: a state dict loaded with assign=True (new Parameters, every
    packed linear and expert repacked), then sleep / wake_up (the caches and state slots
    re-pointed): each time the stack is rebuilt and the steps give the per-layer calls' bits
    of the model as it is then."""
    model = _qwen3_next()
    ps = _prompts([6, 9, 3], seed=7)
    monkeypatch.setattr(hybrid_stack, "QWEN3_NEXT_STACK", True)
    engine = _engine(model)
    _run(engine, ps, 2)
    first = engine.runner.hybrid.stack.stack
    assert first is not None
    g = torch.Generator().manual_seed(5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, v in state.items():
        if name.endswith(("A_log", "experts.down_proj", "input_layernorm.weight", "q_norm.weight",
                          "norm.weight")):
            state[name] = v + (0.3 * torch.randn(v.shape, generator=g)).to(v.dtype)
    model.load_state_dict(state, assign=True)
    calls = _count_stack_calls(monkeypatch, Qwen3NextStack)
    got = [(o.token_ids, o.outputs[0].logprobs) for o in _run(engine, ps, 5, logprobs=3)]
    second = engine.runner.hybrid.stack.stack
    want, _, _ = _logprob_run(model, ps, monkeypatch, False)
    assert got == want
    assert calls and second is not None and second is not first
    monkeypatch.setattr(hybrid_stack, "QWEN3_NEXT_STACK", True)
    engine.sleep(level=1)
    engine.wake_up()
    got = [(o.token_ids, o.outputs[0].logprobs) for o in _run(engine, ps, 5, logprobs=3)]
    assert engine.runner.hybrid.stack.stack is not second
    assert got == want


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_engine_reserves_the_scratch_its_steps_take(family):
    """Engine() grows and writes this thread's kernel scratch (ops/workspace.py) to what its
    largest step takes, so no step of a run grows it (no fresh pages in the first generate());
    sleep(level=2) frees it and wake_up() reserves it again."""
    from cb_kernels.ops import workspace

    workspace.release()
    model = _qwen3_next() if family == "qwen3_next" else _model("residual-fp32").to(torch.bfloat16)
    engine = _engine(model)
    held = workspace.held_bytes()
    assert engine.workspace_bytes == held > 0
    # full prefills of max_batch_tokens rows beside decodes, then decode-only steps
    _run(engine, _prompts([8, 8, 3, 1, 16]), 4)
    assert workspace.held_bytes() == held
    assert engine.sleep(level=2) > 0 and workspace.held_bytes() == 0
    engine.wake_up()
    assert workspace.held_bytes() == held
