"""The Engine on tiny random models: the same greedy tokens as transformers' generate, under
preemption, prefix sharing and cancellations, with the invariants checked after every step."""
import random

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import (ATTN_BACKEND, make_model, make_tokenizer, random_prompts,
                         reference_tokens, run_checked)

pytestmark = pytest.mark.one_thread

LENGTHS = [5, 37, 12, 64, 1, 23, 48, 9]
NEW = [12, 5, 20, 8, 16, 1, 10, 14]


def engine_for(model, **cfg):
    cfg.setdefault("attention_backend", ATTN_BACKEND)
    return Engine(model, EngineConfig(**cfg))


def add_all(engine, prompts, new):
    return [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, new)]


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def qwen3():
    return make_model("qwen3")


@pytest.fixture(scope="module")
def expected(llama):
    prompts = random_prompts(LENGTHS, seed=1)
    return prompts, reference_tokens(llama, prompts, NEW)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_matches_generate(kind, llama, qwen3):
    model = {"llama": llama, "qwen3": qwen3}[kind]
    prompts = random_prompts(LENGTHS, seed=2)
    engine = engine_for(model, block_size=8, num_blocks=128, max_batch_tokens=64)
    ids = add_all(engine, prompts, NEW)
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == reference_tokens(model, prompts, NEW)
    assert all(outs[i].finish_reason == "length" for i in ids)
    assert engine.stats()["used_blocks"] == 0
    m = outs[ids[0]].metrics
    assert m.ttft is not None and m.ttft > 0 and len(m.token_times) == NEW[0]


def test_generate_api_and_model_generate_still_works(llama, expected):
    prompts, ref = expected
    engine = engine_for(llama, block_size=16, num_blocks=64)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in NEW])
    assert [o.token_ids for o in outs] == ref
    assert [o.prompt_token_ids for o in outs] == prompts
    assert llama.config._attn_implementation == "sdpa"
    assert reference_tokens(llama, prompts[:1], NEW[:1]) == ref[:1]


def test_tiny_pool_preempts_many_times_and_keeps_tokens(llama):
    lengths, new = [5, 37, 12, 30, 1, 23, 18, 9], [40, 25, 30, 20, 36, 12, 28, 33]
    prompts = random_prompts(lengths, seed=5)
    ref = reference_tokens(llama, prompts, new)
    # The longest request (37 + 25 tokens) needs 16 blocks of 4: the whole pool.
    engine = engine_for(llama, block_size=4, num_blocks=16, max_batch_tokens=32, max_num_seqs=8,
                        prefix_caching=False, preemption="recompute")
    ids = add_all(engine, prompts, new)
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == ref
    stats = engine.stats()
    assert stats["recomputes"] >= 5, stats
    assert stats["used_blocks"] == 0
    assert sum(outs[i].metrics.num_preemptions for i in ids) == stats["recomputes"]


def test_prefix_sharing_hits_cached_blocks_with_same_tokens(llama):
    system = random_prompts([40], seed=7)[0]
    prompts = random_prompts([3, 11, 6, 20, 1, 9], seed=8, prefix=system)
    new = [10, 6, 12, 4, 8, 9]
    ref = reference_tokens(llama, prompts, new)
    engine = engine_for(llama, block_size=8, num_blocks=40, max_batch_tokens=48, max_num_seqs=4)
    ids = add_all(engine, prompts, new)
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == ref
    stats = engine.stats()
    assert stats["prefix_hit_blocks"] >= 5 * (40 // 8), stats
    assert sum(outs[i].metrics.num_cached_tokens for i in ids) >= 5 * 40
    assert stats["used_blocks"] == 0 and stats["cached_blocks"] > 0


def test_prefix_sharing_with_preemption(llama):
    system = random_prompts([24], seed=9)[0]
    prompts = random_prompts([5, 30, 2, 17, 8, 12, 26, 4], seed=10, prefix=system)
    new = [14, 9, 20, 6, 11, 16, 3, 18]
    ref = reference_tokens(llama, prompts, new)
    engine = engine_for(llama, block_size=4, num_blocks=24, max_batch_tokens=24, max_num_seqs=6,
                        preemption="recompute")
    ids = add_all(engine, prompts, new)
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == ref
    assert engine.stats()["recomputes"] > 0 and engine.stats()["prefix_hit_blocks"] > 0


def test_random_cancellations(llama, expected):
    prompts, ref = expected
    rng = random.Random(3)
    engine = engine_for(llama, block_size=8, num_blocks=20, max_batch_tokens=32, max_num_seqs=6)
    ids = add_all(engine, prompts * 2, NEW * 2)
    cancelled = set()

    def maybe_cancel(step):
        live = [i for i in ids if engine.sequence(i) is not None]
        if live and rng.random() < 0.3:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)

    outs = run_checked(engine, on_step=maybe_cancel)
    assert cancelled and len(outs) == len(ids)
    for k, rid in enumerate(ids):
        want = (ref * 2)[k]
        if rid in cancelled:
            assert outs[rid].finish_reason == "cancelled"
            assert outs[rid].token_ids == want[:len(outs[rid].token_ids)]
        else:
            assert outs[rid].token_ids == want
    assert engine.stats()["used_blocks"] == 0
    with pytest.raises(ValueError, match="not waiting or running"):
        engine.cancel(ids[0])


def test_soak_2000_short_requests_returns_every_block(llama):
    engine = engine_for(llama, block_size=4, num_blocks=48, max_batch_tokens=128,
                        max_num_seqs=64)
    rng = random.Random(4)
    ids = []
    for k in range(2000):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 6))]
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=rng.randint(1, 3))))
    outs = run_checked(engine)
    assert len(outs) == 2000 and all(o.finish_reason == "length" for o in outs.values())
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_stream_deltas_add_up_to_generate(llama, expected):
    prompts, ref = expected
    engine = engine_for(llama, block_size=8, num_blocks=64)
    got = {}
    reasons = {}
    for delta in engine.stream(prompts[:4], [SamplingParams(max_new_tokens=n) for n in NEW[:4]]):
        assert delta.request_id not in reasons, "a delta after the final one"
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.finished:
            reasons[delta.request_id] = delta.finish_reason
    assert list(got.values()) == ref[:4] and set(reasons.values()) == {"length"}


def test_sampling_seed_top_k_and_stop_tokens(llama):
    prompts = random_prompts([6, 30, 14], seed=11)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=123)
    e1 = engine_for(llama, block_size=8, num_blocks=64)
    alone = e1.generate(prompts[:1], sampled)[0].token_ids
    e2 = engine_for(llama, block_size=8, num_blocks=64)
    crowd = e2.generate(prompts, [sampled, SamplingParams(max_new_tokens=5, temperature=1.0),
                                  SamplingParams(max_new_tokens=9)])
    assert crowd[0].token_ids == alone            # the seed, not the neighbours, decides
    greedy = reference_tokens(llama, prompts[:1], [12])[0]
    top1 = e2.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1))
    assert top1[0].token_ids == greedy
    stop = greedy[4]
    out = e2.generate(prompts[:1], SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[:greedy.index(stop) + 1]


def test_eos_from_generation_config(llama):
    prompts = random_prompts([10], seed=12)
    greedy = reference_tokens(llama, prompts, [10])[0]
    engine = engine_for(llama, block_size=8, num_blocks=32)
    engine.runner.eos_token_ids = frozenset([greedy[3]])
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[:greedy.index(greedy[3]) + 1]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == greedy and out.finish_reason == "length"
    assert torch.equal(torch.tensor(out.prompt_token_ids), torch.tensor(prompts[0]))


def test_text_prompts_and_streamed_text(llama):
    tok = make_tokenizer()
    engine = Engine(llama, EngineConfig(block_size=8, num_blocks=32,
                                        attention_backend=ATTN_BACKEND), tokenizer=tok)
    prompts = ["w5 w17 w200 w3", "w42 w7"]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    ids = [tok(p)["input_ids"] for p in prompts]
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == reference_tokens(llama, ids, 6)
    assert [o.text for o in outs] == [tok.decode(o.token_ids) for o in outs]
    streamed = {}
    for delta in engine.stream(prompts, SamplingParams(max_new_tokens=6)):
        streamed[delta.request_id] = streamed.get(delta.request_id, "") + delta.text
    assert list(streamed.values()) == [o.text for o in outs]


def test_auto_config_runs(llama, expected, caplog):
    prompts, ref = expected
    with caplog.at_level("INFO", logger="cb_kernels.engine"):
        engine = Engine(llama, EngineConfig(attention_backend=ATTN_BACKEND))
    assert "EngineConfig.num_blocks auto -> " in caplog.text
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in NEW])
    assert [o.token_ids for o in outs] == ref
    engine.check_invariants()


def test_the_facade_says_what_the_server_reads(llama):
    """Engine.max_positions and num_pool_tokens: what a front end reads, without the parts."""
    engine = Engine(llama, EngineConfig(block_size=4, num_blocks=12))
    assert engine.max_positions == llama.config.max_position_embeddings
    assert engine.num_pool_tokens == 48
