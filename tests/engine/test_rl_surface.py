"""Issue 27: the Engine's RL surface: update_weights by name, weight_version, reset_prefix_cache,
pause / resume, sleep / wake_up."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens

pytestmark = pytest.mark.one_thread

SYSTEM = random_prompts([24], seed=60)[0]


def make_engine(model, overlap="off", **cfg):
    cfg = {"block_size": 8, "num_blocks": 64, "max_batch_tokens": 64, "overlap": overlap,
           "attention_backend": ATTN_BACKEND, **cfg}
    return Engine(model, EngineConfig(**cfg))


def drain(engine) -> dict:
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in outs
            outs[o.request_id] = o
        engine.check_invariants()
    return outs


def greedy(n=6, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


# -- update_weights, weight_version, reset_prefix_cache -----------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_update_weights_by_name_follows_the_new_weights(tied):
    model = make_model(seed=3, tie_word_embeddings=tied)
    other = make_model(seed=4, tie_word_embeddings=tied)
    engine = make_engine(model)
    prompts = random_prompts([3, 9], seed=1, prefix=SYSTEM)
    outs = engine.generate(prompts, greedy())
    assert [o.weight_version for o in outs] == [0, 0] and engine.stats()["weight_version"] == 0
    names = dict(other.named_parameters(remove_duplicate=False))
    assert ("lm_head.weight" in names) and (tied == (names["lm_head.weight"] is
                                                      names["model.embed_tokens.weight"]))
    pushed = list(other.state_dict().items())    # a tied model's state_dict names both
    assert engine.update_weights(iter(pushed)) == 1
    assert engine.weight_version == 1 and engine.stats()["weight_version"] == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight if tied else True
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))
    ids = [engine.add_request(p, greedy()) for p in prompts]
    outs = drain(engine)
    assert [outs[i].token_ids for i in ids] == reference_tokens(other, prompts, 6)
    assert outs[ids[0]].metrics.num_cached_tokens == 0      # the cache was dropped
    assert all(outs[i].weight_version == 1 for i in ids)


def test_update_weights_checks_every_pair_before_writing_any():
    model = make_model(seed=3)
    engine = make_engine(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = ("model.norm.weight", torch.zeros(64))
    with pytest.raises(ValueError, match=r"no parameter 'model.nrom.weight'.*model.norm.weight"):
        engine.update_weights([good, ("model.nrom.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(32,\), the model's "
                                         r"parameter \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(32))])
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        engine.update_weights([("model.norm.weight", [0.0] * 64)])
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        engine.update_weights([torch.zeros(64)])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert engine.weight_version == 0
    assert engine.update_weights({"model.norm.weight": torch.ones(64, dtype=torch.float64)}) == 1


def test_weight_version_counts_changes_step_sees_and_stamps_stream_deltas():
    model = make_model(seed=3)
    engine = make_engine(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.1)
    engine.step()                                 # nothing queued: the check still runs
    assert engine.weight_version == 1
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 0.9)
    deltas = list(engine.stream(random_prompts([4], seed=2), greedy(3)))
    assert deltas and all(d.weight_version == 2 for d in deltas)
    engine.step()
    assert engine.weight_version == 2             # nothing changed since


def test_reset_prefix_cache():
    engine = make_engine(make_model(seed=3))
    engine.generate(random_prompts([4], seed=3, prefix=SYSTEM), greedy())
    assert engine.stats()["cached_blocks"] > 0
    engine.reset_prefix_cache()
    assert engine.stats()["cached_blocks"] == 0
    out = engine.generate(random_prompts([4], seed=4, prefix=SYSTEM), greedy())[0]
    assert out.metrics.num_cached_tokens == 0


# -- pause / resume -----------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_pause_keep_resumes_unchanged(overlap):
    model = make_model(seed=3)
    engine = make_engine(model, overlap)
    prompts = random_prompts([5, 11, 3], seed=5)
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.pause("keep") == [] and engine.is_paused and engine.stats()["paused"]
    late = engine.add_request(prompts[0], greedy(8))     # queued while paused
    state = [list(engine.sequence(i).token_ids) for i in ids]
    for _ in range(3):
        assert engine.step() == []
    assert [engine.sequence(i).token_ids for i in ids] == state
    with pytest.raises(RuntimeError, match="paused engine would wait forever; call resume"):
        engine.generate(prompts, greedy())
    engine.resume()
    assert not engine.is_paused
    outs = drain(engine)
    assert [outs[i].token_ids for i in ids + [late]] == reference_tokens(model, prompts + prompts[:1], 8)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_pause_wait_finishes_what_runs_and_admits_nothing(overlap):
    model = make_model(seed=3)
    engine = make_engine(model, overlap, max_num_seqs=2)
    prompts = random_prompts([5, 7, 4], seed=6)
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    engine.step()                      # two admitted (max_num_seqs=2), the third waits
    outs = engine.pause("wait")
    assert sorted(o.request_id for o in outs) == ids[:2]
    assert [o.token_ids for o in sorted(outs, key=lambda o: o.request_id)] == \
        reference_tokens(model, prompts[:2], 5)
    assert engine.stats()["waiting"] == 1 and engine.stats()["running"] == 0
    engine.check_invariants()
    assert engine.step() == []
    engine.resume()
    assert drain(engine)[ids[2]].token_ids == reference_tokens(model, prompts[2:], 5)[0]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_pause_abort_returns_partial_tokens_and_logprobs(overlap):
    model = make_model(seed=3)
    engine = make_engine(model, overlap)
    prompts = random_prompts([5, 9], seed=7)
    ids = [engine.add_request(p, greedy(20, logprobs=1)) for p in prompts]
    queued = engine.add_request(prompts[0], greedy(20))
    for _ in range(4):
        engine.step()
    outs = {o.request_id: o for o in engine.pause("abort")}
    assert set(outs) == set(ids + [queued]) and engine.is_paused
    want = reference_tokens(model, prompts, 20)
    for i, w in zip(ids, want):
        o = outs[i]
        assert o.finish_reason == "abort" and 0 < len(o.token_ids) < 20
        assert o.token_ids == w[:len(o.token_ids)]          # the tokens computed so far
        assert len(o.outputs[0].logprobs) == len(o.token_ids)
    assert outs[queued].finish_reason == "abort" and engine.stats()["used_blocks"] == 0
    assert not engine.has_unfinished()
    engine.check_invariants()
    engine.resume()
    assert engine.generate(prompts[:1], greedy(4))[0].token_ids == want[0][:4]


def test_pause_refuses_an_unknown_mode():
    engine = make_engine(make_model(seed=3))
    with pytest.raises(ValueError, match="pause mode must be 'keep', 'wait' or 'abort'"):
        engine.pause("drain")
    assert not engine.is_paused


# -- sleep / wake_up ----------------------------------------------------------------------------
def _pool_bytes(engine):
    r = engine.runner
    return sum(t.numel() * t.element_size() for t in r.k_caches + r.v_caches)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_sleep_level_1_frees_the_pool_and_wakes_up_exact(overlap):
    model = make_model(seed=3)
    engine = make_engine(model, overlap)
    prompts = random_prompts([4, 8], seed=8, prefix=SYSTEM)
    assert [o.token_ids for o in engine.generate(prompts, greedy())] == \
        reference_tokens(model, prompts, 6)
    pool = _pool_bytes(engine)
    assert engine.stats()["cached_blocks"] > 0
    assert engine.sleep(level=1) == pool > 0
    assert engine.is_sleeping and engine.stats()["sleeping"] == ["kv_cache"]
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.runner.k_caches)
    assert engine.stats()["cached_blocks"] == 0
    assert engine.sleep(level=1) == 0                    # already asleep: nothing more
    with pytest.raises(RuntimeError, match="sleeping engine would wait forever; call wake_up"):
        engine.generate(prompts, greedy())
    with torch.no_grad():                                # the trainer steps meanwhile
        model.model.layers[0].mlp.up_proj.weight.mul_(1.3)
    engine.wake_up()
    assert not engine.is_sleeping and _pool_bytes(engine) == pool
    assert [o.token_ids for o in engine.generate(prompts, greedy())] == \
        reference_tokens(model, prompts, 6)


def test_sleep_level_2_frees_the_weight_copies_too():
    model = make_model(seed=3)
    engine = make_engine(model)
    prompts = random_prompts([4, 8], seed=9)
    engine.generate(prompts, greedy())
    pool = _pool_bytes(engine)
    packed = engine.runner.packed is not None
    freed = engine.sleep(level=2)
    assert freed > pool if packed else freed >= pool
    assert engine.stats()["sleeping"] == ["kv_cache", "weights"]
    down = torch.nn.Linear(128, 64, bias=False)          # the trainer swaps a submodule
    layer = model.model.layers[0]
    down.load_state_dict({"weight": layer.mlp.down_proj.weight.detach() * -0.5})
    layer.mlp.down_proj = down
    engine.weights_updated()                             # asleep: the rebuild waits for wake_up
    engine.wake_up(["kv_cache"])
    assert engine.is_sleeping and engine.stats()["sleeping"] == ["weights"]
    engine.wake_up(tags=["weights"])
    assert not engine.is_sleeping
    assert [o.token_ids for o in engine.generate(prompts, greedy())] == \
        reference_tokens(model, prompts, 6)
    with pytest.raises(ValueError, match="wake_up tags must be None or a list of"):
        engine.wake_up(["kv"])
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        engine.sleep(level=3)


def test_sleep_with_requests_refuses_waits_or_aborts():
    model = make_model(seed=3)
    engine = make_engine(model)
    prompts = random_prompts([5, 9], seed=10)
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    engine.step()
    with pytest.raises(RuntimeError, match="sleep\\(\\) with 2 requests waiting or running; pass "
                                           "mode='wait'"):
        engine.sleep()
    assert not engine.is_sleeping
    assert engine.sleep(mode="wait") > 0
    outs = drain(engine)                                 # delivered by the next step()
    assert [outs[i].token_ids for i in ids] == reference_tokens(model, prompts, 6)
    engine.wake_up()
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    engine.step()
    assert engine.sleep(mode="abort") > 0
    outs = drain(engine)
    assert all(outs[i].finish_reason == "abort" and len(outs[i].token_ids) == 1 for i in ids)
    late = engine.add_request(prompts[0], greedy(6))
    assert engine.step() == [] and engine.sequence(late).num_generated_tokens == 0   # queued
    engine.wake_up()
    assert drain(engine)[late].token_ids == reference_tokens(model, prompts[:1], 6)[0]


# -- a GRPO round's sampling: every row sampled with processed logprobs -------------------------
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_grpo_rows_processed_logprobs_over_the_whole_vocabulary(top_p):
    """Every row of the batch drawn at temperature 1.3 over the whole vocabulary with processed
    logprobs (the sampler's one-filter path, n=2 forks too): the same tokens as raw mode (each
    batch all one mode), and each logprob the log-softmax of the logits / temperature (top_p
    1) or -inf / finite as top_p keeps the token."""
    import math

    model = make_model(seed=11)
    prompts = random_prompts([7, 12], seed=3)
    common = dict(max_new_tokens=6, temperature=1.3, top_p=top_p, seed=5, logprobs=2, n=2)
    engine = make_engine(model)
    raw = engine.generate(prompts, SamplingParams(**common))
    proc = engine.generate(prompts, SamplingParams(**common, logprobs_mode="processed"))
    for prompt, r, p in zip(prompts, raw, proc):
        assert [c.token_ids for c in r.outputs] == [c.token_ids for c in p.outputs]
        for c in p.outputs:
            tokens = c.token_ids
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
            want = (logits[len(prompt) - 1:] / 1.3).log_softmax(-1)
            for t, (token, entry) in enumerate(zip(tokens, c.logprobs)):
                assert token in entry and len(entry) in (2, 3)
                if top_p == 1.0:
                    assert all(abs(lp - want[t, tid].item()) < 1e-4 for tid, lp in entry.items())
                else:     # renormalized over the kept tokens: at least the chosen one's mass
                    assert math.isfinite(entry[token])
                    assert entry[token] >= want[t, token].item() - 1e-4
