"""Engine() pays the one-time costs of a step (engine/warmup.py): the user's first generate()
builds no packed weight, layer table, rotary table or greedy-head copy, and the warm-up writes
nothing to the KV pool and leaves no engine state behind."""
import logging

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.runner import TransformersRunner
from tests.helpers import make_model, random_prompts, reference_tokens


def one_time_work(runner) -> dict:
    """What a step builds on first use, counted since the runner was made."""
    return {"packs": sum(g.num_packs for g in runner.packed.groups),
            "layer_tables": runner.fused.num_table_builds,
            "rotary_tables": runner.fused.rotary.num_builds,
            "greedy_packs": runner.head.greedy.num_packs}


CONFIG = dict(max_batch_tokens=48, max_num_seqs=8, cpu_offload_gib=0, greedy_head=True)
# A prompt longer than max_batch_tokens (chunked prefill), short ones, a decode batch of 4.
LENGTHS = [3, 17, 40, 90]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_first_generate_builds_nothing(dtype, caplog):
    model = make_model("llama").to(dtype)
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        engine = Engine(model, EngineConfig(**CONFIG))
    assert any(r.getMessage().startswith("warm-up: a 48-token prefill and a 8-row decode step")
               for r in caplog.records)
    runner = engine.runner
    assert runner.fused is not None and runner.packed is not None and \
        runner.head.greedy is not None          # the paths the warm-up is for run here
    before = one_time_work(runner)
    assert before["layer_tables"] == 1       # by the warm-up
    # The warm-up wrote no K/V, took no block, ran no engine step.
    assert not any(k.any() or v.any() for k, v in zip(runner.k_caches, runner.v_caches))
    stats = engine.stats()
    assert stats["steps"] == 0 and stats["used_blocks"] == 0 and stats["cached_blocks"] == 0
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(max_new_tokens=6)] * 3 + \
        [SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)]
    outs = engine.generate(prompts, params)
    assert one_time_work(runner) == before
    engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0
    if dtype == torch.float32:      # the greedy requests: transformers' tokens
        assert [o.token_ids for o in outs[:3]] == reference_tokens(model, prompts[:3], 6)


def test_a_runner_without_warmup_builds_in_the_first_step():
    """The counters see the work: a runner the Engine did not build is not warmed up (its
    owner's business), and its first step builds the tables."""
    model = make_model("llama")
    runner = TransformersRunner(model, greedy_head=True)
    engine = Engine(model, EngineConfig(**CONFIG), runner=runner)
    assert engine.warmup_s == 0.0
    before = one_time_work(runner)
    engine.generate(random_prompts([5], seed=1), SamplingParams(max_new_tokens=2))
    after = one_time_work(runner)
    assert after["layer_tables"] == before["layer_tables"] + 1
    assert after["rotary_tables"] == before["rotary_tables"] + 1


def test_warmup_prefill_is_capped(monkeypatch, caplog):
    """The warm-up prefill stops at warmup.PREFILL_TOKENS when the budget is larger (its compute
    grows with its length, what it warms does not): the first generate(), whose prefill steps
    are the budget's 48 tokens, still builds nothing, and its tokens are the same."""
    from cb_kernels.engine import warmup

    monkeypatch.setattr(warmup, "PREFILL_TOKENS", 16)
    model = make_model("llama").to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        engine = Engine(model, EngineConfig(**CONFIG))
    assert any(r.getMessage().startswith("warm-up: a 16-token prefill and a 8-row decode step")
               for r in caplog.records)
    runner = engine.runner
    before = one_time_work(runner)
    prompts = random_prompts(LENGTHS, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert one_time_work(runner) == before
    assert engine.stats()["used_blocks"] == 0
    monkeypatch.setattr(warmup, "PREFILL_TOKENS", 512)       # the whole 48-token budget
    uncapped = Engine(model, EngineConfig(**CONFIG))
    assert [o.token_ids for o in outs] == \
        [o.token_ids for o in uncapped.generate(prompts, SamplingParams(max_new_tokens=6))]
