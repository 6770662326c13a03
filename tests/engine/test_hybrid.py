"""Hybrid and recurrent models: per-sequence state slots beside the paged KV cache.

Tiny random fp32 models of three families that carry state differently (Mamba: selective scan,
no attention; Qwen3-Next: gated delta-net + full attention; Jamba: Mamba + attention + MoE) give
model.generate's greedy tokens alone, in mixed batches with chunked prefills, under memory
pressure with swap and with recompute, with cancellations and n > 1 forks; no state slot leaks
(the invariants hold after every step), and a random workload fuzz (hypothesis) drives it all at
once.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cb_kernels import Engine, EngineConfig, SamplingParams, UnsupportedModelError
from tests.model_sweep import VOCAB, generate_tokens, tiny_model

pytestmark = pytest.mark.one_thread

FAMILIES = {
    "mamba": dict(tie_word_embeddings=False, initializer_range=0.5),   # not one repeated token
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2),
}
_MODELS: dict = {}


def model_of(family):
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=3, **FAMILIES[family])
    return _MODELS[family]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


_WANT: dict = {}


def want(family, prompt, max_new):
    key = (family, tuple(prompt), max_new)
    if key not in _WANT:
        _WANT[key] = generate_tokens(model_of(family), [prompt], max_new)[0]
    return _WANT[key]


def greedy(max_new, **kw):
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, **kw)


def drive(engine, reqs, cancel_at=None):
    """Add `reqs` [(prompt, params)], step to the end checking invariants after every step;
    cancel_at: {index: step}. Returns the outputs by index."""
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    index = {rid: i for i, rid in enumerate(ids)}
    outs, step = {}, 0
    while engine.has_unfinished():
        for i, at in (cancel_at or {}).items():
            if at == step and engine.sequence(ids[i]) is not None:
                engine.cancel(ids[i])
        for o in engine.step():
            outs[index[o.request_id]] = o
        engine.check_invariants()
        step += 1
        assert step < 500, engine.stats()
    return outs


def assert_no_leak(engine):
    s = engine.stats()
    assert s["used_blocks"] == 0 and s["state_slots_used"] == 0, s
    assert s["host_used_blocks"] == 0, s
    if engine.swapper is not None and engine.swapper.state_offload is not None:
        assert engine.swapper.state_offload.host_used_blocks == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_batch_with_chunked_prefill(family):
    """Four prompts (1 to 22 tokens) in an 8-token budget: prefills cut into chunks that carry
    the state between steps, decodes and prefill chunks in one step; generate's tokens."""
    model = model_of(family)
    ps = prompts_of([1, 5, 13, 22], seed=1)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=8,
                                        max_num_seqs=4))
    assert engine.resolved.prefix_caching is True and engine.resolved.overlap == "off"
    outs = drive(engine, [(p, greedy(6)) for p in ps])
    for i, p in enumerate(ps):
        assert outs[i].token_ids == want(family, p, 6), (family, i)
    s = engine.stats()
    assert s["state_slots_total"] == 4 and s["state_bytes_per_slot"] > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_memory_pressure(family, preemption):
    """Six requests in a pool that holds about two: preemption by swap (the state slot moves to
    the host with the blocks) or by recompute (the state is rebuilt from the tokens)."""
    model = model_of(family)
    ps = prompts_of([9, 11, 6, 10, 7, 12], seed=2)
    engine = Engine(model, EngineConfig(
        block_size=4, num_blocks=9, max_batch_tokens=16, max_num_seqs=4,
        preemption=preemption, cpu_offload_gib=0.01 if preemption == "swap" else None))
    outs = drive(engine, [(p, greedy(8)) for p in ps])
    for i, p in enumerate(ps):
        assert (outs[i].finish_reason, outs[i].token_ids) == ("length", want(family, p, 8)), \
            (family, i, outs[i].error)
    s = engine.stats()
    assert s["preemptions"] > 0, s
    if preemption == "swap":
        assert s["swaps_out"] > 0 and s["swaps_in"] == s["swaps_out"], s
        assert engine.swapper.state_offload.swaps_out == s["swaps_out"]
    else:
        assert s["recomputes"] > 0, s
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["mamba", "qwen3_next"])
def test_cancel_and_forks(family):
    """n=2 greedy forks start from a copy of the parent's state after its prefill (both samples
    are generate's tokens); cancelling a decoding and a waiting request frees their slots."""
    model = model_of(family)
    ps = prompts_of([7, 10, 4, 12], seed=4)
    # Prefix caching off: with it, the child may wait for a seat and hit the parent's state
    # checkpoint instead (test_hybrid_prefix.py); here the fork copy itself is under test.
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=16,
                                        max_num_seqs=3, prefix_caching=False))
    reqs = [(ps[0], greedy(6, n=2)), (ps[1], greedy(6)), (ps[2], greedy(6)),
            (ps[3], greedy(6))]
    outs = drive(engine, reqs, cancel_at={1: 3, 3: 1})
    assert [c.token_ids for c in outs[0].outputs] == [want(family, ps[0], 6)] * 2
    assert outs[2].token_ids == want(family, ps[2], 6)
    for i in (1, 3):
        assert outs[i].finish_reason == "cancelled"
        assert outs[i].token_ids == want(family, ps[i], 6)[:len(outs[i].token_ids)]
    assert engine.stats()["state_fork_copies"] == 1
    assert_no_leak(engine)


# Every other family the sweep runs (tests/test_model_sweep.py), with chunked prefills here.
MORE = {
    "mamba2": {}, "falcon_mamba": {}, "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]), "falcon_h1": {},
    "zamba2": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "nemotron_h": {}, "lfm2": dict(layer_types=["conv", "full_attention"]),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "minimax": {}, "olmo_hybrid": {},
    "recurrent_gemma": dict(num_hidden_layers=3, attention_window_size=5),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", list(MORE))
def test_more_families_with_chunked_prefill(family):
    """Three prompts in a 4-token budget (prefills in chunks beside decodes): generate's tokens.
    Zamba2's one shared attention block serves two layers (each call its own KV)."""
    torch.manual_seed(0)
    model = tiny_model(family, seed=7, **MORE[family])
    ps = prompts_of([2, 7, 11], seed=8)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=4,
                                        max_num_seqs=3))
    outs = drive(engine, [(p, greedy(5)) for p in ps])
    assert [outs[i].token_ids for i in range(3)] == generate_tokens(model, ps, 5)
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["rwkv", "xlstm"])
def test_unsupported_stateful_families_are_refused(family):
    """RWKV and xLSTM keep their state in objects of their own (no transformers cache
    interface, no attention): refused at Engine(), naming why."""
    with pytest.raises(UnsupportedModelError, match="no layer keeps its state"):
        Engine(tiny_model(family), EngineConfig(block_size=4, num_blocks=16))


def test_layer_that_drops_its_state_is_refused():
    """A mixer that reads the cache interface but forgets the earlier tokens when it continues
    passes the static checks; the construction-time carry check refuses it (a step would give
    other tokens than generate)."""
    from transformers.models.mamba.modeling_mamba import MambaMixer

    class ForgetfulMixer(MambaMixer):
        def forward(self, hidden_states, **kwargs):
            key = "cache" if "cache" in kwargs else "cache_params"     # 5.24 / 5.17
            cache = kwargs.get(key)
            if cache is not None and cache.has_previous_state(self.layer_idx):
                kwargs[key] = None        # continues as if nothing came before
            return super().forward(hidden_states, **kwargs)

    model = tiny_model("mamba", seed=5, **FAMILIES["mamba"])
    for block in model.backbone.layers:
        block.mixer.__class__ = ForgetfulMixer
    with pytest.raises(UnsupportedModelError, match="a decode step give other logits"):
        Engine(model, EngineConfig(block_size=4, num_blocks=16))


def test_model_is_unchanged_after_steps():
    """The slot wrappers live only inside a step: generate() afterwards runs the model's own
    forward (same tokens as before the engine ran)."""
    model = tiny_model("mamba", seed=6, **FAMILIES["mamba"])
    p = prompts_of([8], seed=6)[0]
    before = generate_tokens(model, [p], 5)[0]
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=32))
    assert engine.generate([p], greedy(5))[0].token_ids == before
    assert all("forward" not in b.mixer.__dict__ for b in model.backbone.layers)
    assert generate_tokens(model, [p], 5)[0] == before


# -- fuzz ---------------------------------------------------------------------------------------
@st.composite
def workloads(draw):
    n = draw(st.integers(1, 6))
    reqs = [dict(length=draw(st.integers(1, 14)), seed=draw(st.integers(0, 99)),
                 max_new=draw(st.integers(1, 6)), n=draw(st.sampled_from([1, 1, 2])),
                 cancel=draw(st.integers(0, 25))) for _ in range(n)]    # > 15: never
    preemption = draw(st.sampled_from(["swap", "recompute", "auto"]))
    return dict(reqs=reqs, family=draw(st.sampled_from(["mamba", "qwen3_next"])),
                preemption=preemption, extra_blocks=draw(st.integers(0, 4)),
                max_num_seqs=draw(st.integers(1, 4)),
                max_batch_tokens=draw(st.sampled_from([4, 8, 32])),
                host_gib=draw(st.sampled_from([1e-5, 0.01])))


def pressure_example(family, preemption):
    """Six 10-14-token requests (one forked, one cancelled mid-decode) in a pool for about two."""
    reqs = [dict(length=10 + i % 5, seed=40 + i, max_new=6, n=2 if i == 1 else 1,
                 cancel=6 if i == 3 else 99) for i in range(6)]
    return dict(reqs=reqs, family=family, preemption=preemption, extra_blocks=1,
                max_num_seqs=4, max_batch_tokens=8, host_gib=0.01)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
@example(w=pressure_example("mamba", "swap"))
@example(w=pressure_example("qwen3_next", "recompute"))
@example(w=pressure_example("mamba", "auto"))
def test_random_workloads_keep_state_exact(w):
    """Random arrivals, lengths, forks, cancellations, tight pools and both preemption modes:
    after every step the block, slot and host-pool invariants hold; at the end nothing is held
    and every finished sample has generate's tokens (a cancelled one a prefix of them)."""
    family = w["family"]
    model = model_of(family)
    bs = 4
    reqs = [(prompts_of([r["length"]], seed=r["seed"])[0], r) for r in w["reqs"]]
    need = max(-(-(len(p) + r["max_new"] - 1) // bs) for p, r in reqs)
    engine = Engine(model, EngineConfig(
        block_size=bs, num_blocks=need + w["extra_blocks"],
        max_batch_tokens=max(w["max_batch_tokens"], w["max_num_seqs"]),
        max_num_seqs=w["max_num_seqs"], preemption=w["preemption"],
        cpu_offload_gib=None if w["preemption"] == "recompute" else w["host_gib"]))
    outs = drive(engine, [(p, greedy(r["max_new"], n=r["n"])) for p, r in reqs],
                 cancel_at={i: r["cancel"] for i, (_, r) in enumerate(reqs) if r["cancel"] <= 15})
    assert set(outs) == set(range(len(reqs)))
    for i, (p, r) in enumerate(reqs):
        expected = want(family, p, r["max_new"])
        for c in outs[i].outputs:
            if outs[i].finish_reason == "cancelled":
                assert c.token_ids == expected[:len(c.token_ids)], (i, c.token_ids)
            else:
                assert c.token_ids == expected, (i, outs[i].error)
    assert_no_leak(engine)
