"""Issue 27 under tensor parallelism: sleep / wake_up / update_weights / reset_prefix_cache /
weights_updated reach every rank (2 CPU ranks over gloo, the launcher of
test_tensor_parallel.py), and the weights a trainer changes in place on each rank's shard are
followed. Tokens are compared with transformers' generate of the whole model in this process."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from helpers import make_model, random_prompts, reference_tokens
from test_tensor_parallel import _launch

pytestmark = pytest.mark.one_thread

PROMPTS = random_prompts([5, 17, 9], seed=21)
GREEDY = SamplingParams(max_new_tokens=8)
# model kind -> (make_model overrides, EngineConfig kwargs): the fused forward with the whole
# vocabulary split; Qwen2's q/k/v biases (split with their rows) and a tied head on
# transformers' path
KINDS = {"llama": ({}, {}),
         "qwen2": ({"tie_word_embeddings": True}, {"pack_weights": False})}
FIRST, SECOND = 0, 5          # make_model seeds: the model served, the weights pushed


def _model(kind, seed):
    return make_model(kind, seed=seed, **KINDS[kind][0])


def _tokens(outputs):
    return [o.token_ids for o in outputs]


def _train_in_place(model):
    """What a trainer does to each rank's shard (and the reference to the whole model): a
    `mul_` (the version counters move) and a fused AdamW step (no version counter moves) with
    a constant gradient; both are elementwise, so the shards change as the whole does."""
    params = [p for p in model.parameters()]
    with torch.no_grad():
        for p in params:
            p.mul_(0.75)
    for p in params:
        p.grad = torch.full_like(p, 0.02)
    opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    opt.step()
    for p in params:
        p.grad = None


def _spmd(kind, rank):
    """Every rank calls the same methods, as it calls generate()."""
    engine = Engine(_model(kind, FIRST), EngineConfig(tensor_parallel_size=2, **KINDS[kind][1]))
    r = {"first": _tokens(engine.generate(PROMPTS, GREEDY))}
    r["freed"] = engine.sleep(2)
    s = engine.stats()
    r["asleep"] = (s["sleeping"], s["sleep_freed_bytes"], engine.is_sleeping,
                   engine.runner.k_caches[0].numel())
    engine.wake_up()
    r["awake"] = (engine.is_sleeping, tuple(engine.runner.k_caches[0].shape))
    pushed = _model(kind, SECOND).state_dict() if rank == 0 else None
    r["version"] = engine.update_weights(pushed)
    try:                    # refused on rank 0: rank 1, waiting in the same call, raises it too
        engine.update_weights({"lm_head.weigth": torch.zeros(2)} if rank == 0 else None)
        r["refused"] = None
    except ValueError as e:
        r["refused"] = str(e)
    r["second"] = _tokens(engine.generate(PROMPTS, GREEDY))
    r["second_versions"] = [o.weight_version for o in engine.generate(PROMPTS[:1], GREEDY)]
    engine.reset_prefix_cache()
    _train_in_place(engine.model)           # each rank its own shard
    r["trained"] = _tokens(engine.generate(PROMPTS, GREEDY))
    r["trained_version"] = engine.weight_version
    return r


def _refusals(engine, rank, second):
    """Rank 0 pushes bad pairs while rank 1 follows: each refused on rank 0, no rank changed."""
    if rank != 0:
        before = {n: p.clone() for n, p in engine.model.named_parameters()}
        engine.follow()
        return all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    sd = second.state_dict()
    errors = []
    bad = [
        # a typo in the last name: the earlier, good pairs are not written either
        list(sd.items())[:-1] + [("model.layers.1.mlp.down_proj.weigth", sd[
            "model.layers.1.mlp.down_proj.weight"])],
        # rank 0's own split shape, not the whole model's
        [("model.layers.0.self_attn.q_proj.weight",
          sd["model.layers.0.self_attn.q_proj.weight"][:32])],
        [("model.norm.weight", torch.ones(64, dtype=torch.int64))],
    ]
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    for pairs in bad:
        try:
            engine.update_weights(pairs)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    unchanged = all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    engine.release()
    return errors, unchanged, engine.weight_version


def _modes(engine, rank):
    """Rank 0 sleeps with requests in flight while rank 1 follows: refused without a mode,
    aborted, or finished first; then weights pushed and a weights_updated() after a write
    torch cannot see, both reaching rank 1."""
    if rank != 0:
        return engine.follow()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    r = {}
    for p in PROMPTS[:2]:
        engine.add_request(p, params)
    engine.step()
    try:
        engine.sleep(1)
    except RuntimeError as e:
        r["busy"] = str(e)
    r["abort_freed"] = engine.sleep(1, mode="abort")
    r["aborted"] = [(o.finish_reason, len(o.token_ids)) for o in engine.step()]
    engine.wake_up()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.sleep(2, mode="wait")
    r["stats"] = {k: engine.stats()[k] for k in ("sleeping", "sleep_freed_bytes")}
    done = {o.request_id: o.token_ids for o in engine.step()}
    r["waited"] = [done[i] for i in ids]
    engine.wake_up()
    engine.release(r)
    return r


def _rl_main(rank, queue):
    try:
        results = {kind: _spmd(kind, rank) for kind in KINDS}
        engine = Engine(_model("llama", SECOND), EngineConfig(tensor_parallel_size=2))
        results["refusals"] = _refusals(engine, rank, _model("llama", FIRST))
        results["modes"] = _modes(engine, rank)
        # a write torch cannot see, on each rank's shard; weights_updated() on rank 0 alone
        with torch.no_grad():
            for p in engine.model.parameters():
                p.data.copy_(p * 0.5)
        if rank == 0:
            engine.weights_updated()
            engine.release()
        else:
            engine.follow()
        results["halved"] = _tokens(engine.generate(PROMPTS, GREEDY))
        queue.put((rank, results))
    except BaseException as e:                      # noqa: BLE001 (reported to the test)
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


@pytest.fixture(scope="module")
def rl_results():
    results = _launch(_rl_main, (), timeout_s=30, wait_s=240)
    assert set(results) == {0, 1}, results
    for rank, (r,) in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"
    return results[0][0], results[1][0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_sleep_wake_update_equal_generate_of_the_pushed_model(rl_results, kind):
    first, second = _model(kind, FIRST), _model(kind, SECOND)
    for r in rl_results:
        r = r[kind]
        assert r["first"] == reference_tokens(first, PROMPTS, 8)
        # sleep(2) + wake_up + update_weights(the second model's state_dict) on every rank
        assert r["second"] == reference_tokens(second, PROMPTS, 8)
        assert r["version"] == 1 and r["second_versions"] == [1]
        assert r["refused"].startswith("update_weights: the model has no parameter "
                                       "'lm_head.weigth'")
        assert r["awake"][0] is False and r["awake"][1][2] == 1     # one KV head a rank
    rank0, rank1 = (r[kind]["asleep"] for r in rl_results)
    # every rank frees its own pool and copies: the sum on every rank, each rank's in stats()
    assert rank0[1] == rank1[1] and len(rank0[1]) == 2 and min(rank0[1]) > 0
    assert rl_results[0][kind]["freed"] == rl_results[1][kind]["freed"] == sum(rank0[1])
    for sleeping, _, is_sleeping, numel in (rank0, rank1):
        assert sleeping == ["kv_cache", "weights"] and is_sleeping and numel == 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_weights_changed_in_place_on_each_shard_are_followed(rl_results, kind):
    model = _model(kind, SECOND)
    _train_in_place(model)
    want = reference_tokens(model, PROMPTS, 8)
    for r in rl_results:
        assert r[kind]["trained"] == want
        # rank 0 saw the change (version 2: the push, then the training); rank 1 reports it too
        assert r[kind]["trained_version"] == 2


def test_bad_pushes_refused_on_rank_0_and_no_rank_changed(rl_results):
    errors, unchanged, version = rl_results[0]["refusals"]
    assert errors == [
        "ValueError: update_weights: the model has no parameter "
        "'model.layers.1.mlp.down_proj.weigth' (names as model.named_parameters() gives them; "
        "close: ['model.layers.1.mlp.down_proj.weight', 'model.layers.0.mlp.down_proj.weight', "
        "'model.layers.1.mlp.up_proj.weight'])",
        "ValueError: update_weights: 'model.layers.0.self_attn.q_proj.weight' has shape "
        "(32, 64), the model's parameter (64, 64)",
        "TypeError: update_weights: 'model.norm.weight' is torch.int64, the parameter "
        "torch.float32"]
    assert unchanged and version == 0
    assert rl_results[1]["refusals"] is True          # rank 1 (in follow()) kept its shard


def test_sleep_with_requests_in_flight_follows_the_modes(rl_results):
    rank0, rank1 = (r["modes"] for r in rl_results)
    assert rank1 == rank0                  # follow() returned what rank 0 released
    assert rank0["busy"] == ("sleep() with 2 requests waiting or running; pass mode='wait' "
                             "(finish them first) or mode='abort' (end them now)")
    assert rank0["abort_freed"] > 0
    assert sorted(rank0["aborted"]) == [("abort", 1), ("abort", 1)]
    assert rank0["waited"] == reference_tokens(_model("llama", SECOND), PROMPTS, 8)
    assert rank0["stats"]["sleeping"] == ["kv_cache", "weights"]
    assert len(rank0["stats"]["sleep_freed_bytes"]) == 2


def test_weights_updated_on_rank_0_rebuilds_every_rank(rl_results):
    model = _model("llama", SECOND)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    want = reference_tokens(model, PROMPTS, 8)
    assert rl_results[0]["halved"] == rl_results[1]["halved"] == want
