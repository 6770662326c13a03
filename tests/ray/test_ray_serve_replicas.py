"""Serving past one machine: a Ray Data job sends its rows through cb_kernels.ray.ServeClient to two
`cb-kernels serve` processes; the answers equal one Engine's greedy text, both replicas served,
and with one replica stopped every row is still answered (by the other).

Needs the `ray` and `serve` extras; CI installs both (CBK_REQUIRE_RAY_TESTS=1 and
CBK_REQUIRE_SERVE_TESTS=1 make a missing one fail there).
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("CBK_REQUIRE_RAY_TESTS"):
    import ray
else:
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

from tests.serve.test_serve_http import NAME, Server  # noqa: E402  (skips without the serve extra)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("replica_logs")
    started = []
    try:
        for i in range(2):
            started.append(Server(model_dir, logs / f"replica{i}.log"))
        yield started
    finally:
        for s in started:
            s.stop()


def _rows():
    rows = [{"id": f"t{i}", "prompt": " ".join(f"w{(11 * i + j) % 290 + 1}" for j in range(3 + i % 7))}
            for i in range(12)]
    rows += [{"id": f"c{i}", "messages": [{"role": "user", "content": f"w{20 + i} w{40 + i}"}]}
             for i in range(4)]
    rows.append({"id": "own-length", "prompt": "w5 w6", "max_new_tokens": 3})
    return rows


def _expected(model_dir) -> dict:
    import torch

    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.models import load

    model, tok = load(model_dir, dtype="float32")
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64), tokenizer=tok)
    want = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in _rows():
            prompt = tok.apply_chat_template(r["messages"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) \
                if "messages" in r else r["prompt"]
            params = SamplingParams(max_new_tokens=r.get("max_new_tokens", 6), ignore_eos=True)
            want[r["id"]] = engine.generate([prompt], params)[0].text
    finally:
        torch.set_num_threads(threads)
    return want


def _run(urls) -> dict:
    from cb_kernels.ray.http import ServeClient

    ds = ray.data.from_items(_rows(), override_num_blocks=4).map_batches(
        ServeClient, batch_size=5, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        batch_format="pyarrow", fn_constructor_kwargs={
            "urls": urls, "model": NAME, "max_in_flight": 8,
            "defaults": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}})
    return {r["id"]: r for r in ds.take_all()}


def test_rows_spread_over_serve_replicas_and_survive_one(cluster, model_dir, servers):
    want = _expected(model_dir)
    urls = [s.url for s in servers]
    got = _run(urls)
    assert set(got) == set(want)
    for rid, text in want.items():
        assert got[rid]["error"] is None and got[rid]["text"] == text, (rid, got[rid])
        assert got[rid]["finish_reason"] == "length"
    assert {r["replica"] for r in got.values()} == set(urls)       # both replicas answered

    servers[1].stop()                          # one replica gone: its rows go to the other
    got = _run(urls)
    assert {rid: r["text"] for rid, r in got.items()} == want
    assert {r["replica"] for r in got.values()} == {urls[0]}


def test_serve_client_checks_its_arguments_and_rows():
    import pyarrow as pa

    from cb_kernels.ray.http import ServeClient

    with pytest.raises(ValueError, match="urls must be a non-empty list"):
        ServeClient("http://x", model="m")
    client = ServeClient(["http://127.0.0.1:9"], model="m", timeout_s=5)
    out = client(pa.table({"id": ["a", "b"], "text_in": ["x", "y"]})).to_pydict()  # no prompt
    assert out["finish_reason"] == ["error", "error"] and out["id"] == ["a", "b"]
    assert out["error"][0] == "expected exactly one of 'prompt', 'messages', 'prompt_token_ids'"
    out = client(pa.table({"prompt": ["w1"]})).to_pydict()  # nothing listens on port 9 (discard)
    assert out["error"][0].startswith("no replica answered: http://127.0.0.1:9: ")
    with pytest.raises(TypeError, match=r"batch_format='pyarrow'\) is needed"):
        client({"prompt": ["w1"]})
