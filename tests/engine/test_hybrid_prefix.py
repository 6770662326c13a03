"""Prefix caching for hybrid models: the stateful layers' state checkpointed at block boundaries.

Each test runs the same requests through an engine with prefix caching on and one with it off
(fp32, one thread) and asserts the greedy tokens are equal, token for token, while the stats
prove the cache was hit (restored checkpoints, cached tokens). Block size 4 with conv kernels of
4 (the tiny models' default): every restored conv window spans a block boundary.
"""
from __future__ import annotations

import pytest
import torch

from cb_kernels import Engine, EngineConfig
from tests.engine.test_hybrid import FAMILIES, MORE, assert_no_leak, drive, greedy, model_of, \
    prompts_of
from tests.model_sweep import tiny_model

pytestmark = pytest.mark.one_thread

_MORE_MODELS: dict = {}


def family_model(family):
    if family in FAMILIES:
        return model_of(family)
    if family not in _MORE_MODELS:
        torch.manual_seed(0)
        _MORE_MODELS[family] = tiny_model(family, seed=7, **MORE[family])
    return _MORE_MODELS[family]


def shared_prefix_prompts(n, prefix_len, seed):
    """`n` prompts of one shared `prefix_len`-token prefix and different tails (3 to 9 tokens)."""
    prefix = prompts_of([prefix_len], seed=seed)[0]
    tails = prompts_of([3 + (5 * i) % 7 for i in range(n)], seed=seed + 1)
    return [prefix + t for t in tails]


def run_pair(model, rounds, **config):
    """Run `rounds` (each a list of (prompt, params), one drive() each, in order) through one
    engine with prefix caching and one without; returns (outputs on, outputs off, engine on)."""
    outs = {}
    for on in (True, False):
        engine = Engine(model, EngineConfig(prefix_caching=on, **config))
        assert engine.resolved.prefix_caching is on
        outs[on] = [drive(engine, reqs) for reqs in rounds]
        assert_no_leak(engine)
        if on:
            engine_on = engine
    return outs[True], outs[False], engine_on


def tokens(round_outs):
    return [[c.token_ids for c in round_outs[i].outputs] for i in sorted(round_outs)]


BASE = dict(block_size=4, num_blocks=96, max_batch_tokens=32, max_num_seqs=4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prefix_batch_and_second_round(family):
    """Round 1: six prompts with a 13-token shared prefix, four seats (two wait and hit the
    checkpoint the second one saved at the shared end); round 2: the same prompts again (each
    hits its own last full block, or the shared prefix). Tokens equal the run without the
    cache."""
    model = model_of(family)
    ps = shared_prefix_prompts(6, 13, seed=11)
    reqs = [(p, greedy(5)) for p in ps]
    on, off, engine = run_pair(model, [reqs, reqs], **BASE)
    assert [tokens(r) for r in on] == [tokens(r) for r in off]
    s = engine.stats()
    assert s["state_checkpoint_hits"] >= 6 + 2, s
    # 4: one per seat (max_num_seqs), far under the cap (a quarter of the memory beside the
    # explicit KV pool; test_explicit_num_blocks_caps_the_checkpoints).
    assert s["state_checkpoints_total"] == 4 and s["state_checkpoint_saves"] > 0, s
    # Round 2 restores either the prompt's own last-full-block checkpoint or, where the LRU of
    # the 4 checkpoints dropped that one, the shared prefix's (12 tokens: 3 blocks of 13).
    cached = [on[1][i].metrics.num_cached_tokens for i in range(6)]
    assert all(c in (12, ((len(p) - 1) // 4) * 4) for c, p in zip(cached, ps)), cached
    assert any(c > 12 for c in cached), cached


@pytest.mark.parametrize("family", ["qwen3_next", "mamba"])
def test_forks_hit_the_parents_checkpoint(family):
    """n=2 with one seat: the second sample waits for the seat and prefills from the prefix
    cache, starting from the checkpoint the parent's prefill saved; both samples are the run
    without the cache's (and generate's: n=2 greedy samples are equal)."""
    model = model_of(family)
    ps = prompts_of([11, 9], seed=12)
    reqs = [(ps[0], greedy(4, n=2)), (ps[1], greedy(4))]
    on, off, engine = run_pair(model, [reqs], block_size=4, num_blocks=64, max_batch_tokens=16,
                               max_num_seqs=1)
    assert tokens(on[0]) == tokens(off[0])
    assert tokens(on[0])[0][0] == tokens(on[0])[0][1]
    assert engine.stats()["state_checkpoint_hits"] >= 1


@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests(family, preemption):
    """Six requests with a shared prefix in a pool for about two: preempted by recompute (the
    re-prefill hits a checkpoint of its own prompt or the shared prefix) or by swap (the slot
    travels; checkpoints stay on the device)."""
    model = model_of(family)
    ps = shared_prefix_prompts(6, 9, seed=13)
    reqs = [(p, greedy(8)) for p in ps]
    config = dict(block_size=4, num_blocks=11, max_batch_tokens=16, max_num_seqs=4,
                  preemption=preemption, cpu_offload_gib=0.01 if preemption == "swap" else None)
    on, off, engine = run_pair(model, [reqs], **config)
    assert tokens(on[0]) == tokens(off[0])
    s = engine.stats()
    assert s["preemptions"] > 0 and s["state_checkpoint_hits"] > 0, s


def test_weight_update_and_sleep_drop_every_checkpoint():
    """Checkpoints die with the prefix cache: after reset_prefix_cache(), a weight update and
    sleep/wake_up none is left, and the next round (new weights) has the tokens of a fresh
    engine with the cache off."""
    model = tiny_model("qwen3_next", seed=3, **FAMILIES["qwen3_next"])
    ps = shared_prefix_prompts(3, 9, seed=14)
    engine = Engine(model, EngineConfig(**BASE))
    engine.generate(ps, greedy(3))
    assert engine.stats()["state_checkpoints_used"] > 0
    engine.reset_prefix_cache()
    assert engine.stats()["state_checkpoints_used"] == 0
    engine.generate(ps, greedy(3))
    assert engine.stats()["state_checkpoints_used"] > 0
    with torch.no_grad():
        w = model.lm_head.weight
        engine.update_weights([("lm_head.weight", w.flip(0).clone())])
    assert engine.stats()["state_checkpoints_used"] == 0
    engine.generate(ps, greedy(3))
    freed = engine.sleep(level=1)
    assert freed > 0 and engine.stats()["state_checkpoints_used"] == 0
    engine.wake_up()
    engine.generate(ps, greedy(3))            # all miss (one batch): checkpoints saved
    before = engine.stats()["state_checkpoint_hits"]
    got = [o.token_ids for o in engine.generate(ps, greedy(4))]
    fresh = Engine(model, EngineConfig(prefix_caching=False, **BASE))
    assert got == [o.token_ids for o in fresh.generate(ps, greedy(4))]
    assert engine.stats()["state_checkpoint_hits"] > before
    engine.check_invariants()


# The other families of the sweep (transformers' layer code or our kernels), one case each.
@pytest.mark.parametrize("family", list(MORE))
def test_more_families_shared_prefix(family):
    """Four prompts with a 10-token shared prefix in a 8-token budget (prefills in chunks),
    then the same prompts again: the run without the cache's tokens, and hits in round 2."""
    model = family_model(family)
    ps = shared_prefix_prompts(4, 10, seed=15)
    reqs = [(p, greedy(4)) for p in ps]
    on, off, engine = run_pair(model, [reqs, reqs], block_size=4, num_blocks=96,
                               max_batch_tokens=8, max_num_seqs=3)
    assert [tokens(r) for r in on] == [tokens(r) for r in off]
    assert engine.stats()["state_checkpoint_hits"] >= 4


def test_explicit_num_blocks_caps_the_checkpoints(monkeypatch):
    """An explicit num_blocks does not lift the checkpoints' cap: as on the auto path, they take
    at most a quarter of the memory budget (here 40% of 10 MiB of host memory, less the state
    slots and the given KV pool), at least one; before, they were max_num_seqs-many whatever
    the memory (256 checkpoints of an 80B model's state on a GPU)."""
    import dataclasses

    from cb_kernels.engine import sizing

    shape = sizing.ModelShape(num_layers=4, num_kv_heads=2, head_dim=32, max_positions=2048,
                              dtype=torch.float32, device=torch.device("cpu"))
    shape = dataclasses.replace(shape, state_bytes_per_seq=64 << 10)
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 10 << 20)
    budget = int((10 << 20) * sizing.CPU_KV_FRACTION)
    per_block = sizing.kv_bytes_per_block(shape, 16, torch.float32)
    config = dict(block_size=16, max_num_seqs=32, max_batch_tokens=64, prefix_caching=True)
    explicit = sizing.resolve(EngineConfig(num_blocks=8, **config), shape)
    left = budget - 32 * (64 << 10) - 8 * per_block
    assert explicit.num_state_checkpoints == left // 4 // (64 << 10) < 32
    auto = sizing.resolve(EngineConfig(**config), shape)
    assert 1 <= auto.num_state_checkpoints < 32
    tight = sizing.resolve(EngineConfig(num_blocks=80, **config), shape)   # nothing left
    assert tight.num_state_checkpoints == 1
