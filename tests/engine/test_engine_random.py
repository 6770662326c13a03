"""Randomized workloads (hypothesis): tiny pools, swap / recompute / prefix caching, overlap,
arrivals and cancellations at any step (the last live request included), seeded sampled requests,
and a weight update between rounds. After every step: each request that ended has delivered
exactly one output, the invariants hold; at the end nothing leaks and every request's tokens equal
a run without memory pressure (a cancelled one: a prefix of them)."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, VOCAB, make_model, random_prompts

pytestmark = pytest.mark.one_thread

MAX_PROMPT, MAX_NEW = 20, 12


@pytest.fixture(scope="module")
def base_model():
    return make_model("llama", seed=12)


@st.composite
def requests(draw, prefix):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        out.append(dict(
            prompt=(prefix if draw(st.booleans()) else []) +
            random_prompts([draw(st.integers(1, MAX_PROMPT))], seed=draw(st.integers(0, 999)))[0],
            max_new=draw(st.integers(1, MAX_NEW)),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**31))),     # sampled when set
            arrive=draw(st.integers(0, 4)),
            cancel=draw(st.integers(0, 40))))     # steps after arrival; > 30: never
    return out


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 8]))
    prefix = random_prompts([draw(st.sampled_from([0, block_size, 2 * block_size + 3]))],
                            seed=draw(st.integers(0, 999)))[0]
    rounds = [draw(requests(prefix)) for _ in range(2)]
    preemption = draw(st.sampled_from(["recompute", "swap", "auto"]))
    return dict(
        block_size=block_size, rounds=rounds,
        update=draw(st.sampled_from(["inplace", "load_state_dict", "data_copy"])),
        extra_blocks=draw(st.integers(0, 3)),
        host_blocks=0 if preemption == "recompute" else draw(st.sampled_from([2, 8, 64])),
        preemption=preemption, prefix_caching=draw(st.booleans()),
        overlap=draw(st.sampled_from(["off", "on"])), max_num_seqs=draw(st.integers(2, 6)),
        cancel_last=draw(st.booleans()))


def params_of(r) -> SamplingParams:
    if r["seed"] is None:
        return SamplingParams(max_new_tokens=r["max_new"], ignore_eos=True)
    return SamplingParams(max_new_tokens=r["max_new"], temperature=0.8, top_k=20, seed=r["seed"],
                          ignore_eos=True)


def no_pressure_tokens(model, reqs) -> list:
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=256, max_batch_tokens=512,
                                        prefix_caching=False, overlap="off",
                                        attention_backend=ATTN_BACKEND))
    return [o.token_ids for o in engine.generate([r["prompt"] for r in reqs],
                                                 [params_of(r) for r in reqs])]


def update_weights(engine, model, kind, seed) -> None:
    new = make_model("llama", seed=seed)
    with torch.no_grad():
        if kind == "inplace":
            for p, q in zip(model.parameters(), new.parameters()):
                p.add_(q, alpha=0.5)
        elif kind == "load_state_dict":
            model.load_state_dict(new.state_dict())
        else:
            for p, q in zip(model.parameters(), new.parameters()):
                p.data.copy_(q)
            engine.weights_updated()


def run_round(engine, reqs, cancel_last) -> tuple:
    """Drive `engine` through one round; returns (outputs by index, cancelled indices)."""
    ids, outs, cancelled, step = {}, {}, set(), 0
    by_id = {}
    while len(ids) < len(reqs) or engine.has_unfinished():
        for i, r in enumerate(reqs):
            if i not in ids and r["arrive"] <= step:
                ids[i] = engine.add_request(r["prompt"], params_of(r))
                by_id[ids[i]] = i
        live = [i for i in ids if engine.sequence(ids[i]) is not None]
        for i in live:
            if step - reqs[i]["arrive"] == reqs[i]["cancel"]:
                engine.cancel(ids[i])
                cancelled.add(i)
        live = [i for i in live if i not in cancelled]
        if cancel_last and len(live) == 1 and len(ids) == len(reqs):
            engine.cancel(ids[live[0]])
            cancelled.add(live[0])
        for o in engine.step():
            i = by_id[o.request_id]
            assert i not in outs, f"a second output for request {i}"
            outs[i] = o
        ended = {i for i in ids if engine.sequence(ids[i]) is None}
        assert ended == set(outs), f"ended without an output: {sorted(ended - set(outs))}"
        engine.check_invariants()
        step += 1
        assert step < 2000, engine.stats()
    return outs, cancelled


def pressure_example(preemption, overlap, update, seed):
    """Eight requests sharing a 2-block prefix in a pool that holds about three of them: many
    preemptions and prefix hits in every round (the drawn examples cover the corners)."""
    prefix = random_prompts([19], seed=seed)[0]
    rounds = [[dict(prompt=prefix + random_prompts([1 + 3 * i], seed=seed + 10 * k + i)[0],
                    max_new=12, seed=None if i % 3 else 7 + i, arrive=i // 3,
                    cancel=5 if i == 4 else 99) for i in range(8)] for k in range(2)]
    return dict(block_size=8, rounds=rounds, update=update, extra_blocks=3,
                host_blocks=0 if preemption == "recompute" else 64, preemption=preemption,
                prefix_caching=True, overlap=overlap, max_num_seqs=6, cancel_last=True)


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(w=workloads())
@example(w=pressure_example("swap", "on", "inplace", seed=50))
@example(w=pressure_example("recompute", "off", "load_state_dict", seed=51))
@example(w=pressure_example("auto", "on", "data_copy", seed=52))
def test_random_workloads(base_model, w):
    model = copy.deepcopy(base_model)
    bs = w["block_size"]
    need = max(-(-(len(r["prompt"]) + r["max_new"] - 1) // bs) for reqs in w["rounds"] for r in reqs)
    block_bytes = 2 * 2 * bs * 2 * 16 * 4        # layers * K/V * block_size * kv heads * head_dim * fp32
    engine = Engine(model, EngineConfig(
        block_size=bs, num_blocks=need + w["extra_blocks"], max_batch_tokens=max(16, w["max_num_seqs"]),
        max_num_seqs=w["max_num_seqs"], preemption=w["preemption"],
        cpu_offload_gib=w["host_blocks"] * block_bytes / (1 << 30),
        prefix_caching=w["prefix_caching"], overlap=w["overlap"], attention_backend=ATTN_BACKEND))
    for k, reqs in enumerate(w["rounds"]):
        if k:
            update_weights(engine, model, w["update"], seed=100 + k)
        want = no_pressure_tokens(model, reqs)
        outs, cancelled = run_round(engine, reqs, w["cancel_last"])
        assert set(outs) == set(range(len(reqs)))
        for i, o in outs.items():
            if i in cancelled:
                assert o.finish_reason == "cancelled"
                assert o.token_ids == want[i][:len(o.token_ids)], (k, i)
            else:
                assert (o.finish_reason, o.token_ids) == ("length", want[i]), (k, i, o.error)
        st_ = engine.stats()
        assert st_["used_blocks"] == 0 and st_["host_used_blocks"] == 0, st_
        assert all(0 <= t < VOCAB for o in outs.values() for t in o.token_ids)
