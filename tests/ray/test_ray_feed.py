"""Continuous feeding across batches: a replica's next batch enters its engine while the current
batch's last rows run (counted by cb_kernels.ray.feed.EngineFeed's stats, not by timing), with
the same greedy tokens as one Engine; and a feed that stops answers every waiting call.

Needs the `ray` extra (CI installs it and sets CBK_REQUIRE_RAY_TESTS=1).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

if os.environ.get("CBK_REQUIRE_RAY_TESTS"):
    import ray
else:
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

from cb_kernels import Engine, EngineConfig, SamplingParams  # noqa: E402
from cb_kernels.ray import EngineReplica, ProcessorConfig, map_batches_args  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
CONFIG = EngineConfig(block_size=16, num_blocks=64)


def _prompts(count: int, seed: int = 0) -> list:
    return [[(7 * i + 3 * j + seed) % 290 + 1 for j in range(3 + (5 * i) % 11)]
            for i in range(count)]


def _reference(model_dir, prompts) -> list:
    """One Engine's greedy tokens (1 torch thread, as a replica runs)."""
    import torch

    from cb_kernels.models import load

    model, _ = load(model_dir, dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [o.token_ids for o in Engine(model, CONFIG).generate(prompts, PARAMS)]
    finally:
        torch.set_num_threads(threads)


def _hold_second_step(replica, deadline_s: float = 60.0) -> None:
    """Makes the feed's 2nd engine step wait until a second batch has come (admitted or in its
    inbox; or deadline_s passes): the first batch's 8-token rows are then still running when it
    comes, so whether it joins them depends on the feed alone, not on which thread is faster."""
    step, feed = replica.engine.step, replica.feed

    def held():
        if feed.stats()["steps"] == 2:
            end = time.monotonic() + deadline_s
            while feed.stats()["batches"] + feed._inbox.qsize() < 2 and time.monotonic() < end:
                time.sleep(0.01)
        return step()

    replica.engine.step = held


def test_a_second_batch_joins_the_first_in_the_engine(model_dir):
    import pyarrow as pa

    first, second = _prompts(6), _prompts(5, seed=11)
    replica = EngineReplica(str(model_dir), dtype="float32", engine_config=CONFIG,
                            sampling_params=PARAMS)
    try:
        _hold_second_step(replica)
        out = {}

        def call(name, prompts):
            out[name] = replica(pa.table({"prompt_token_ids": prompts}))

        a = threading.Thread(target=call, args=("first", first))
        a.start()
        while replica.feed.stats()["batches"] == 0:        # the first batch is in the engine
            time.sleep(0.01)
        call("second", second)
        a.join(120)
        assert not a.is_alive()
        stats = replica.feed.stats()
        call("third", first)                      # alone: one batch after another joins none
        alone = {k: replica.feed.stats()[k] - stats[k] for k in stats}
    finally:
        replica.feed.close()
    assert stats["batches"] == 2 and stats["rows"] == 11
    assert stats["joined_batches"] == 1          # the second came while the first ran
    # Steps with rows of both batches in the engine: at least the first batch's 7 remaining
    # decode steps (8 tokens, one per step; the 2nd step was held until the second batch came).
    assert stats["shared_steps"] >= 6
    assert alone["batches"] == 1 and alone["joined_batches"] == 0 and alone["shared_steps"] == 0
    want = _reference(model_dir, first + second)
    got = [out[k].column("token_ids").to_pylist() for k in ("first", "second", "third")]
    assert got[0] + got[1] == want and got[2] == want[:len(first)]


def test_a_stopped_feed_answers_every_call(model_dir):
    import pyarrow as pa

    replica = EngineReplica(str(model_dir), dtype="float32", engine_config=CONFIG,
                            sampling_params=PARAMS)

    def broken_step():
        raise RuntimeError("the device fell off")

    replica.engine.step = broken_step
    errors = []

    def call():
        try:
            replica(pa.table({"prompt_token_ids": _prompts(3)}))
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 3 and all("the device fell off" in e for e in errors)
    with pytest.raises(RuntimeError, match="engine stopped: .*the device fell off"):
        replica(pa.table({"prompt_token_ids": _prompts(1)}))
    # A batch of bad rows only (nothing enters the engine) is answered without a step.
    ok = EngineReplica(str(model_dir), dtype="float32", engine_config=CONFIG)
    try:
        res = ok(pa.table({"prompt_token_ids": [[5000]]})).to_pydict()
        assert res["finish_reason"] == ["error"] and "5000" in res["error"][0]
    finally:
        ok.feed.close()


class _Recording(EngineReplica):
    """EngineReplica that holds its 2nd step as above and writes its feed's stats to `log_dir`
    after every batch (one file per actor process)."""

    def __init__(self, model, *, log_dir, **kwargs):
        super().__init__(model, **kwargs)
        self.log = os.path.join(log_dir, f"{os.getpid()}.json")
        _hold_second_step(self)

    def __call__(self, batch):
        out = super().__call__(batch)
        with open(self.log, "w") as f:
            json.dump(self.feed.stats(), f)
        return out


def test_ray_feeds_a_replica_its_next_batch_while_one_runs(cluster, model_dir, tmp_path):
    """Through Ray Data with map_batches_args (what build_processor and `generate --ray` use),
    2 batches in flight: Ray gives a replica its next batch while one runs, and it joins the
    running one in the engine; the tokens equal one Engine's. (Which replica runs how many
    batches is Ray's choice: a replica that is ready first may run them all.) With 1 in flight
    Ray runs an actor's calls one at a time (its ActorPoolStrategy's contract), the lockstep
    that bench/bench_ray.py compares against."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # tests/ is not on the
    prompts = _prompts(24)                                            # workers' path
    config = ProcessorConfig(model=str(model_dir), dtype="float32", replicas=2, batch_size=6,
                             batches_in_flight=2, sampling_params=PARAMS,
                             engine_config=CONFIG)
    args = map_batches_args(config)
    args["fn_constructor_kwargs"]["log_dir"] = str(tmp_path)
    ds = ray.data.from_items([{"key": i, "prompt_token_ids": p} for i, p in enumerate(prompts)],
                             override_num_blocks=8)
    rows = ds.map_batches(_Recording, **args).take_all()
    assert sorted(r["key"] for r in rows) == list(range(24))
    want = _reference(model_dir, prompts)
    assert all(list(r["token_ids"]) == want[r["key"]] for r in rows)
    stats = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert 1 <= len(stats) <= 2 and sum(s["batches"] for s in stats) == 8
    assert any(s["joined_batches"] >= 1 and s["shared_steps"] >= 6 for s in stats), stats
