"""Tensor parallelism inside a Ray replica (cb_kernels.ray.ranks): one replica of 2 CPUs on the
local cluster, itself rank 0, its follower a child process (gloo); greedy rows equal the
single-engine command's; a follower SIGKILLed mid-job ends the replica with the lost rank named,
Ray restarts it with new ranks and retries its batches: no row lost or duplicated.

Needs the `ray` extra; CI installs it and sets CBK_REQUIRE_RAY_TESTS=1, so there these run.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import pytest

if os.environ.get("CBK_REQUIRE_RAY_TESTS"):
    import ray
else:
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

from cb_kernels import cli  # noqa: E402

PROMPTS = [[(11 * i + 5 * j) % 290 + 1 for j in range(3 + (7 * i) % 19)] for i in range(18)]


def _argv(model_dir, src, dst, *extra):
    return ["generate", "--model", str(model_dir), "--input", str(src), "--output", str(dst),
            "--dtype", "float32", "--max-new-tokens", "8", "--ignore-eos", "--block-size", "16",
            "--num-blocks", "64", *extra]


def _followers() -> list:
    """Pids of the replicas' follower ranks (python -m cb_kernels.ray.ranks)."""
    import psutil

    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if "cb_kernels.ray.ranks" in " ".join(p.info["cmdline"] or ())]


def test_a_tensor_parallel_replica_gives_the_single_engine_rows(cluster, model_dir, tmp_path):
    import torch

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n"
                           for i, p in enumerate(PROMPTS)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(_argv(model_dir, src, tmp_path / "one.jsonl")) == 0
    finally:
        torch.set_num_threads(threads)
    seen, done = set(), threading.Event()

    def watch():                         # the follower rank exists while the job runs
        while not done.is_set():
            seen.update(_followers())
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert cli.main(_argv(model_dir, src, tmp_path / "tp.jsonl", "--ray", "--replicas",
                              "1", "--cpus-per-replica", "2", "--tensor-parallel-size", "2",
                              "--ray-batch-size", "6")) == 0
    finally:
        done.set()
        watcher.join()
    assert len(seen) == 1, seen
    one = {json.loads(x)["id"]: x for x in (tmp_path / "one.jsonl").read_text().splitlines()}
    tp = [json.loads(x) for x in (tmp_path / "tp.jsonl").read_text().splitlines()]
    assert len(tp) == len(one) == len(PROMPTS)
    for row in tp:            # the same lines (tensor_parallel_size is not in the fingerprint)
        assert json.dumps(row, ensure_ascii=False) == one[row["id"]], row["id"]
    assert not _followers()   # ray.shutdown ended the replica; its follower followed


def test_a_killed_follower_fails_its_replica_and_a_retry_rebuilds(cluster, model_dir):
    from cb_kernels import EngineConfig, SamplingParams
    from cb_kernels.ray import ProcessorConfig, build_processor

    config = ProcessorConfig(
        model=str(model_dir), dtype="float32", replicas=1, num_cpus=2, batch_size=6,
        sampling_params=SamplingParams(max_new_tokens=48, ignore_eos=True),
        engine_config=EngineConfig(block_size=16, num_blocks=64, tensor_parallel_size=2,
                                   tensor_parallel_timeout_s=20))
    ds = ray.data.from_items([{"key": i, "prompt_token_ids": p} for i, p in enumerate(PROMPTS)],
                             override_num_blocks=6)
    rows, killed, seen = [], [], set()
    t0 = time.monotonic()
    for n, batch in enumerate(build_processor(config)(ds).iter_batches(batch_size=None,
                                                                      batch_format="numpy")):
        seen.update(_followers())
        if n == 0:
            (pid,) = _followers()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        rows += [(int(k), list(t)) for k, t in zip(batch["key"], batch["token_ids"])]
    assert killed and time.monotonic() - t0 < 200
    assert sorted(k for k, _ in rows) == list(range(len(PROMPTS)))     # none lost, none twice
    assert all(len(t) == 48 for _, t in rows)
    assert seen - set(killed), "no follower was started again"
    # the replica said why it ended (Ray's log of the actor's stderr)
    logs = ray._private.worker._global_node.get_logs_dir_path()
    said = [f for f in glob.glob(os.path.join(logs, "worker-*.err"))
            if "lost step with the other ranks" in open(f, errors="replace").read()]
    assert said, "no replica logged the lost rank"
    text = open(said[0], errors="replace").read()
    assert "tensor parallelism: rank 0 of 2" in text and "this replica exits" in text


def test_a_follower_that_cannot_load_names_its_rank_and_reason(tmp_path):
    """Rank 0 waits for every follower's model before the rendezvous: a follower that cannot load
    it fails the replica at start with its rank and reason, not a rendezvous timeout."""
    from cb_kernels import EngineConfig
    from cb_kernels.ray.ranks import Followers

    followers = Followers(3, dict(model=str(tmp_path / "no-such-model"), dtype="float32",
                                  device="cpu", engine_config=EngineConfig(tensor_parallel_size=3),
                                  trust_remote_code=False, threads=1))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor parallelism in this replica: rank 1 of 3 could "
                                           r"not load the model: \w+Error: .*no-such-model"):
        followers.wait_loaded(60)
    assert time.monotonic() - t0 < 60
    assert all(p.poll() is not None for p in followers.procs)       # none left behind
