"""Regression tests of issue 18: the prefix cache follows weight updates, an interrupt inside a
step leaves nothing half-registered, the drain loop delivers every output, automatic ids never
collide, generate() queues nothing when a prompt cannot be checked."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens

pytestmark = pytest.mark.one_thread

SYSTEM = random_prompts([32], seed=40)[0]        # 4 shared blocks of 8


def make_engine(model, overlap="off", **cfg):
    cfg = {"block_size": 8, "num_blocks": 64, "max_batch_tokens": 64, "overlap": overlap,
           "attention_backend": ATTN_BACKEND, **cfg}
    return Engine(model, EngineConfig(**cfg))


def drain(engine) -> dict:
    """The documented loop; every output by request id (each exactly once)."""
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in outs, f"two outputs for {o.request_id}"
            outs[o.request_id] = o
        engine.check_invariants()
    return outs


def check_round(engine, model, seed):
    prompts = random_prompts([3, 9, 5], seed=seed, prefix=SYSTEM)
    hits = engine.stats()["prefix_hit_blocks"]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, 6)
    assert engine.stats()["prefix_hit_blocks"] > hits       # the round did share its prefix


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_prefix_cache_follows_weight_updates(overlap):
    model = make_model("llama", seed=3)
    other = make_model("llama", seed=4)
    engine = make_engine(model, overlap)
    check_round(engine, model, seed=41)
    with torch.no_grad():                                     # an optimizer-like in-place step
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    check_round(engine, model, seed=42)
    model.load_state_dict(other.state_dict())                 # copies in place
    check_round(engine, model, seed=43)
    resets = engine.stats()["prefix_resets"]
    with torch.no_grad():                                     # invisible to the version counters
        for p, q in zip(model.parameters(), make_model("llama", seed=5).parameters()):
            p.data.copy_(q)
    engine.weights_updated()
    assert engine.stats()["prefix_resets"] == resets + 1
    check_round(engine, model, seed=44)
    assert not hasattr(engine, "refresh_weights")             # the old name is gone
    assert engine.stats()["used_blocks"] == 0


def test_a_running_request_never_shares_kv_of_old_weights():
    """A request that computed its prefix before the update keeps running, but its blocks are
    never offered to a request that arrives after it."""
    model = make_model("llama", seed=6)
    engine = make_engine(model)
    long = engine.add_request(SYSTEM + [7, 8], SamplingParams(max_new_tokens=20))
    engine.step()                                  # its prefix is computed (and registered)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    fresh = SYSTEM + [9]
    rid = engine.add_request(fresh, SamplingParams(max_new_tokens=6))
    outs = drain(engine)
    assert outs[rid].token_ids == reference_tokens(model, [fresh], 6)[0]
    assert outs[rid].metrics.num_cached_tokens == 0 and outs[long].finish_reason == "length"


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_keyboard_interrupt_in_a_step_leaves_no_unwritten_hash(overlap, monkeypatch):
    model = make_model("llama", seed=7)
    engine = make_engine(model, overlap)
    prompt = SYSTEM + [11, 12, 13]
    real, calls = engine.runner.execute, [0]

    def execute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=5))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.check_invariants()
    if engine.sequence(rid) is not None:       # what the user does next
        engine.cancel(rid)
    outs = drain(engine)
    outs.update((o.request_id, o) for o in engine.step())     # (drain is another test's case)
    assert outs[rid].finish_reason in ("error", "cancelled")
    assert engine.stats()["used_blocks"] == 0
    again = engine.generate([prompt], SamplingParams(max_new_tokens=5))[0]
    assert again.token_ids == reference_tokens(model, [prompt], 5)[0]


def test_keyboard_interrupt_while_decoding_with_overlap(monkeypatch):
    """Interrupted with a step in flight: both steps' requests end once, no placeholder stays."""
    model = make_model("llama", seed=7)
    engine = make_engine(model, "on")
    prompts = random_prompts([5, 12], seed=45, prefix=SYSTEM)
    real, calls = engine.runner.execute, [0]

    def execute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    outs = {}
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            outs.update((o.request_id, o) for o in engine.step())
    engine.check_invariants()
    outs.update(drain(engine))
    ref = reference_tokens(model, prompts, 8)
    for rid, want in zip(ids, ref):
        assert outs[rid].finish_reason == "error" and "KeyboardInterrupt" in outs[rid].error
        assert outs[rid].token_ids == want[:len(outs[rid].token_ids)]
    assert engine.stats()["used_blocks"] == 0
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=8))] == ref


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_drain_loop_delivers_the_output_of_the_last_request_cancelled(overlap):
    engine = make_engine(make_model("llama", seed=8), overlap)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=10))
    engine.step()
    engine.cancel(rid)
    assert engine.has_unfinished()
    outs = drain(engine)
    assert list(outs) == [rid] and outs[rid].finish_reason == "cancelled"
    assert not engine.has_unfinished() and engine.step() == []


def test_automatic_ids_skip_user_ids():
    model = make_model("llama", seed=9)
    engine = make_engine(model)
    prompts = random_prompts([4, 6, 8, 3], seed=46)
    a = engine.add_request(prompts[0], SamplingParams(max_new_tokens=4), request_id="req_1")
    b = engine.add_request(prompts[1], SamplingParams(max_new_tokens=4))
    engine.add_request(prompts[2], SamplingParams(max_new_tokens=4), request_id="req_3")
    assert a == "req_1" and b not in ("req_1", "req_3")
    outs = engine.generate(prompts[2:], SamplingParams(max_new_tokens=4))   # req_3 is live
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert len({a, b, "req_3", *(o.request_id for o in outs)}) == 5
    rest = drain(engine)
    assert set(rest) == {a, b, "req_3"}
    assert [rest[a].token_ids, rest[b].token_ids] == reference_tokens(model, prompts[:2], 4)
    # An ended user request's id stays out of the automatic ones too: its output may still be
    # waiting for the next step() when generate() runs.
    last = int(engine.add_request(prompts[3], SamplingParams(max_new_tokens=2))[4:])
    drain(engine)
    mine = f"req_{last + 1}"                         # the automatic id that would come next
    engine.add_request(prompts[3], SamplingParams(max_new_tokens=2), request_id=mine)
    engine.cancel(mine)
    out = engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))[0]
    assert out.request_id != mine and out.token_ids == rest[a].token_ids
    assert [o.request_id for o in engine.step()] == [mine]


class _Unreadable:
    """A 1-D 'array' whose values cannot be read."""
    ndim, shape = 1, (3,)

    def tolist(self):
        raise ZeroDivisionError("cannot read")


def test_generate_checks_every_prompt_before_queueing_any():
    model = make_model("llama", seed=10)
    engine = make_engine(model)
    good = random_prompts([6, 4], seed=47)
    outs = engine.generate([good[0], torch.empty(4, dtype=torch.long, device="meta"), good[1]],
                           SamplingParams(max_new_tokens=3))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "meta device" in outs[1].error
    assert not engine.has_unfinished()
    with pytest.raises(ZeroDivisionError):
        engine.generate([good[0], _Unreadable()], SamplingParams(max_new_tokens=3))
    assert not engine.has_unfinished() and engine.stats()["waiting"] == 0
    assert [o.token_ids for o in engine.generate(good, SamplingParams(max_new_tokens=3))] == \
        reference_tokens(model, good, 3)


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    engine = make_engine(make_model("llama", seed=11))
    with pytest.raises(ValueError, match=r"stop_token_ids holds 500, outside the vocabulary \[0, 500\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[3, 500]))
    assert not engine.has_unfinished()
