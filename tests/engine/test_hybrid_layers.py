"""runner/hybrid_layers.py: the engine's own decoder forward for Qwen3-Next and Mamba-2 steps.

Tiny random fp32 models: the steps run on it (not transformers' forward), and give
model.generate's greedy tokens in mixed batches with chunked prefills, at one and two threads;
a model it does not fit (a layer's norm of another class) keeps transformers' forward, logged,
with the same tokens; a forward hook added after Engine() sends the steps back to transformers'
forward (the hook runs)."""
from __future__ import annotations

import logging

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.ops.mamba2_stack import Mamba2Stack
from cb_kernels.runner import hybrid_layers, hybrid_stack
from tests.model_sweep import VOCAB, generate_tokens, tiny_model

pytestmark = pytest.mark.one_thread

# Qwen3-Next with an MoE block after each mixer (its tiny default) and a dense MLP layer;
# Mamba-2 with the fp32 residual stream (its default) and without.
CASES = {
    "qwen3_next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention",
                                                    "linear_attention"],
                                      num_hidden_layers=3, mlp_only_layers=[2])),
    "mamba2": ("mamba2", {}),
    "mamba2-residual-in-dtype": ("mamba2", dict(residual_in_fp32=False)),
}


def _model(case, seed=3):
    family, kw = CASES[case]
    torch.manual_seed(0)
    return tiny_model(family, seed=seed, **kw)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _run(engine, prompts, max_new):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o.token_ids
        engine.check_invariants()
    return [outs[i] for i in ids]


def _engine(model, **kw):
    return Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8,
                                      max_num_seqs=4, **kw))


@pytest.mark.parametrize("case", list(CASES))
def test_steps_run_our_forward_with_generates_tokens(case, monkeypatch):
    model = _model(case)
    engine = _engine(model)
    assert engine.runner.hybrid is not None
    calls = []
    original = hybrid_layers.HybridForward.__call__
    monkeypatch.setattr(hybrid_layers.HybridForward, "__call__",
                        lambda self, *a: calls.append(1) or original(self, *a))
    ps = _prompts([1, 5, 13, 22], seed=1)       # prefill chunks beside decodes (budget 8)
    got = _run(engine, ps, 6)
    assert got == generate_tokens(model, ps, 6)
    assert len(calls) == engine.stats()["steps"]


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
def test_tokens_independent_of_threads(case):
    model = _model(case)
    ps = _prompts([3, 9, 17, 4], seed=2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(_run(_engine(model), ps, 5))
    finally:
        torch.set_num_threads(threads)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
def test_a_layer_it_does_not_fit_keeps_transformers_forward(case, caplog):
    """One layer's input norm replaced by a subclass (its forward may differ): the whole model
    keeps transformers' forward, the reason logged; generate's tokens still."""
    model = _model(case)
    layer = model.model.layers[0] if case == "qwen3_next" else model.backbone.layers[0]
    norm = layer.input_layernorm if case == "qwen3_next" else layer.norm
    norm.__class__ = type("OtherNorm", (type(norm),), {})
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        engine = _engine(model)
    assert engine.runner.hybrid is None
    assert "hybrid forward: transformers' decoder code runs the steps (OtherNorm where" \
        in caplog.text
    ps = _prompts([4, 11], seed=3)
    assert _run(engine, ps, 5) == generate_tokens(model, ps, 5)


def test_disabled_keeps_transformers_forward(monkeypatch):
    monkeypatch.setattr(hybrid_layers, "ENABLED", False)
    model = _model("qwen3_next")
    engine = _engine(model)
    assert engine.runner.hybrid is None
    ps = _prompts([6, 2], seed=4)
    assert _run(engine, ps, 4) == generate_tokens(model, ps, 4)


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
def test_a_hook_added_later_runs(case):
    """A forward hook registered after Engine() (this path would skip it): the steps go through
    transformers' forward, where it runs; the tokens stay generate's."""
    model = _model(case)
    engine = _engine(model)
    assert engine.runner.hybrid is not None
    ps = _prompts([5, 8], seed=5)
    want = generate_tokens(model, ps, 4)
    seen = []
    layer = model.model.layers[0] if case == "qwen3_next" else model.backbone.layers[0]
    handle = layer.register_forward_hook(lambda *a: seen.append(1))
    try:
        got = _run(engine, ps, 4)
    finally:
        handle.remove()
    assert seen and got == want


def test_moe_off_our_ops_keeps_transformers_formula(monkeypatch):
    """With the MoE ops off (as where their SIMD bodies do not run) the forward still runs,
    the router's logits by F.linear and the experts through their own module: generate's
    tokens."""
    from cb_kernels.runner import moe_layers

    monkeypatch.setattr(moe_layers, "MOE", "off")
    model = _model("qwen3_next")
    engine = _engine(model)
    assert engine.runner.hybrid is not None
    assert not engine.runner.packed.experts
    ps = _prompts([7, 3, 12], seed=6)
    assert _run(engine, ps, 5) == generate_tokens(model, ps, 5)


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
def test_follows_weights_and_replaced_modules(case):
    """A norm weight written in place and a norm module replaced after Engine(): the next steps
    read the new ones (generate's tokens of the changed model), on this forward still."""
    model = _model(case)
    engine = _engine(model)
    ps = _prompts([6, 9], seed=7)
    _run(engine, ps, 2)
    final = model.model.norm if case == "qwen3_next" else model.backbone.norm_f
    with torch.no_grad():
        final.weight.add_(0.5)
    layer = model.model.layers[1] if case == "qwen3_next" else model.backbone.layers[1]
    name = "post_attention_layernorm" if case == "qwen3_next" else "norm"
    old = getattr(layer, name)
    new = type(old)(old.weight.shape[0], eps=1e-5)
    with torch.no_grad():
        new.weight.copy_(old.weight * -1.5 + 0.25)
    setattr(layer, name, new)
    assert _run(engine, ps, 5) == generate_tokens(model, ps, 5)
    assert engine.runner.hybrid is not None
    assert any(getattr(lyr, "post_norm", getattr(lyr, "norm", None)).module is new
               for lyr in engine.runner.hybrid.layers)


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
def test_sampled_rows_get_transformers_logits(case, monkeypatch):
    """Rows that need logits (logprobs, a sampled request) take the LM head on this forward's
    rows: their logprobs are transformers' forward's within fp32 rounding, the tokens equal."""
    model = _model(case)
    ps = _prompts([5, 12], seed=9)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(hybrid_layers, "ENABLED", on)
        engine = _engine(model)
        assert (engine.runner.hybrid is not None) == on
        runs.append(engine.generate(ps, params))
    for ours, theirs in zip(*runs):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:
                va = a[t] if isinstance(a[t], float) else a[t].logprob
                vb = b[t] if isinstance(b[t], float) else b[t].logprob
                assert abs(va - vb) < 1e-4, (t, va, vb)


@pytest.mark.parametrize("case", ["qwen3_next", "mamba2"])
@pytest.mark.parametrize("why", ["switched-off", "norm-not-fast"])
def test_separate_calls_where_the_fused_middle_does_not_fit(case, why, monkeypatch, caplog):
    """The stateful layers' middle runs as one ops.fused_hybrid call by default; switched off,
    or where a part does not fit (here: the gated norm's fast body reported absent, as on a CPU
    without AVX-512), each layer keeps the separate conv / scan / norm calls, logged where it is
    the layer's fit: generate's tokens on both paths."""
    from cb_kernels.runner import hybrid_kernels

    model = _model(case)
    ps = _prompts([7, 2, 10], seed=11)
    want = generate_tokens(model, ps, 5)
    fused = _engine(model)
    kernels = [w.kernel for _, w in fused.runner._states._wrapped]
    assert kernels and all(k is not None and k.why_not_fused == "" for k in kernels)
    # Mamba-2: every block and the final norm in one call (ops.Mamba2Stack); Qwen3-Next: each
    # gated delta-net layer up to its MLP
    owner, name = (Mamba2Stack, "run_unchecked") if case == "mamba2" else \
        (hybrid_kernels, "gated_delta_net_block_unchecked")
    real, seen = getattr(owner, name), []
    monkeypatch.setattr(owner, name, lambda *a, **k: seen.append(1) or real(*a, **k))
    assert _run(fused, ps, 5) == want and seen
    if why == "switched-off":
        monkeypatch.setattr(hybrid_kernels, "FUSED", False)
    else:
        monkeypatch.setattr(hybrid_kernels, "gated_rms_norm_fast", lambda: False)
    called = []
    for name in ("gated_delta_net_unchecked", "mamba2_mixer_unchecked", "mamba2_block_unchecked",
                 "gated_delta_net_block_unchecked"):
        monkeypatch.setattr(hybrid_kernels, name, lambda *a, **k: called.append(a))
    monkeypatch.setattr(Mamba2Stack, "run_unchecked", lambda *a, **k: called.append(a))
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        engine = _engine(model)
    assert engine.runner.hybrid is not None
    if why == "norm-not-fast":
        assert "conv, scan and norm as separate calls (its gated norm" in caplog.text
    assert _run(engine, ps, 5) == want and not called


def _count_calls(monkeypatch, module, name):
    real, seen = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def test_attention_layer_is_one_call_with_generates_tokens(monkeypatch):
    """Qwen3-Next's full-attention layer up to its MLP runs as one ops.gated_attention_block
    call a step (chunked prefills beside decodes): generate's tokens."""
    model = _model("qwen3_next")
    engine = _engine(model)
    seen = _count_calls(monkeypatch, hybrid_layers, "gated_attention_block_unchecked")
    ps = _prompts([3, 14, 6, 19], seed=12)
    assert _run(engine, ps, 6) == generate_tokens(model, ps, 6)
    assert len(seen) == engine.stats()["steps"]      # one attention layer in this model


@pytest.mark.parametrize("why", ["switched-off", "projections-on-onednn"])
def test_attention_separate_calls_where_the_one_call_does_not_fit(why, monkeypatch, caplog):
    """Switched off, or with the projections off our GEMM (the call reads their packed
    weights), the attention layer keeps the separate calls, logged where it is the layer's
    fit: generate's tokens."""
    from cb_kernels.runner import packed_linears

    model = _model("qwen3_next")
    ps = _prompts([9, 2, 15], seed=13)
    want = generate_tokens(model, ps, 5)
    if why == "switched-off":
        monkeypatch.setattr(hybrid_layers, "FUSED_ATTENTION", False)
    else:
        monkeypatch.setattr(packed_linears, "GEMM", "onednn")
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        engine = _engine(model)
    assert engine.runner.hybrid is not None
    if why != "switched-off":
        assert "layer 1's attention: separate calls (its projections are not on " \
               "ops.PackedLinear)" in caplog.text
    seen = _count_calls(monkeypatch, hybrid_layers, "gated_attention_block_unchecked")
    assert _run(engine, ps, 5) == want and not seen


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_one_call_is_the_separate_calls_bits_in_bf16(threads, monkeypatch):
    """bf16 (the bench's dtype): the one call and the separate calls give the same logprobs
    bit for bit over decodes and chunked prefills, at one and two threads."""
    model = _model("qwen3_next").to(torch.bfloat16)
    monkeypatch.setattr(hybrid_stack, "QWEN3_NEXT_STACK", False)    # its per-layer calls
    ps = _prompts([4, 17, 9, 1], seed=14)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3)
    saved = torch.get_num_threads()
    runs = []
    try:
        torch.set_num_threads(threads)
        for on in (True, False):
            monkeypatch.setattr(hybrid_layers, "FUSED_ATTENTION", on)
            engine = _engine(model)
            assert engine.runner.hybrid is not None
            seen = _count_calls(monkeypatch, hybrid_layers, "gated_attention_block_unchecked")
            runs.append([(o.token_ids, o.outputs[0].logprobs) for o in engine.generate(ps, params)])
            assert bool(seen) == on
    finally:
        torch.set_num_threads(saved)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("why", ["switched-off", "experts-off", "large-steps"])
def test_mlp_in_one_call_and_its_fallbacks(why, monkeypatch, caplog):
    """Every Qwen3-Next MLP (the MoE blocks and the dense layer) runs as one ops.moe_block call
    by default, with the separate calls' bits (the same tokens, BLOCK on and off); switched off,
    with the experts off our ops (logged), or on steps of torch_scalar_rows rows or more (a
    64-token budget), the MLPs run as the separate calls: generate's tokens on every path."""
    from cb_kernels.ops.moe_block import torch_scalar_rows
    from cb_kernels.runner import moe_layers

    model = _model("qwen3_next")
    ps = _prompts([7, 2, 10, 40], seed=12)
    want = generate_tokens(model, ps, 5)
    real, seen = hybrid_layers.moe_block_unchecked, []
    monkeypatch.setattr(hybrid_layers, "moe_block_unchecked",
                        lambda *a, **k: seen.append((a[0].shape[0], a[4] is not None)) or
                        real(*a, **k))
    engine = _engine(model)
    assert all(layer.block_fits for layer in engine.runner.hybrid.layers)
    assert _run(engine, ps, 5) == want and seen
    if why == "switched-off":
        monkeypatch.setattr(moe_layers, "BLOCK", False)
    elif why == "experts-off":
        monkeypatch.setattr(moe_layers, "MOE", "off")
    seen.clear()
    with caplog.at_level(logging.INFO, logger="cb_kernels"):
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4,
                                            max_batch_tokens=64 if why == "large-steps" else 8))
    assert _run(engine, ps, 5) == want
    if why == "large-steps":
        # The MoE layers' large steps went apart; the dense layer's (no sigmoid gate) did not.
        moe_rows = [n for n, routed in seen if routed]
        bound = torch_scalar_rows(torch.float32)
        assert moe_rows and max(moe_rows) < bound
        assert max(n for n, routed in seen if not routed) >= bound
        assert len(moe_rows) < 2 * engine.stats()["steps"]         # two MoE layers a step
    elif why == "experts-off":          # the dense layer's MLP still in one call
        assert seen and not any(routed for _, routed in seen)
    else:
        assert not seen
    if why == "experts-off":
        assert "layer 0's MLP runs as separate calls (its router or experts are not on our " \
               "packed ops)" in caplog.text


def test_mlp_in_one_call_same_bits_in_bf16(monkeypatch):
    """bf16 steps at one and two threads: the forward's final hidden rows with every MLP as one
    ops.moe_block call equal those of the separate calls, bit for bit."""
    from cb_kernels.runner import moe_layers

    model = _model("qwen3_next").to(torch.bfloat16)
    monkeypatch.setattr(hybrid_stack, "QWEN3_NEXT_STACK", False)    # its per-layer calls
    ps = _prompts([6, 3, 9], seed=13)
    rows, seen = [], []
    original = hybrid_layers.HybridForward.__call__
    monkeypatch.setattr(hybrid_layers.HybridForward, "__call__",
                        lambda self, *a: rows.append(original(self, *a)) or rows[-1])
    real = hybrid_layers.moe_block_unchecked
    monkeypatch.setattr(hybrid_layers, "moe_block_unchecked",
                        lambda *a, **k: seen.append(1) or real(*a, **k))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = {}
            for block in (True, False):
                monkeypatch.setattr(moe_layers, "BLOCK", block)
                rows.clear()
                tokens = _run(_engine(model), ps, 4)
                got[block] = (tokens, [r.clone() for r in rows])
                assert bool(seen) == block
                seen.clear()
            assert got[True][0] == got[False][0]
            assert len(got[True][1]) == len(got[False][1]) > 0
            assert all(torch.equal(a, b) for a, b in zip(got[True][1], got[False][1]))
    finally:
        torch.set_num_threads(threads)
