"""cb_kernels.ray.serve_app under Ray Serve on the tests' local cluster: two replicas of the tiny
model behind Serve's HTTP proxy answer OpenAI requests (the official client: completions, chat,
streaming) with one Engine's greedy text, and a bad request gets `cb-kernels serve`'s error body.

Needs the `ray` extra (ray[data,serve]) and the serve extra; CI installs both
(CBK_REQUIRE_RAY_TESTS=1 makes a missing one fail there).
"""
from __future__ import annotations

import os
import socket

import pytest

if os.environ.get("CBK_REQUIRE_RAY_TESTS"):
    from ray import serve
else:
    serve = pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")
pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")

NAME = "tiny"
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(cluster, model_dir):
    from cb_kernels import EngineConfig
    from cb_kernels.ray.serve_app import serve_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(serve_app(str(model_dir), replicas=2, dtype="float32", served_model_name=NAME,
                            engine_config=EngineConfig(block_size=16, num_blocks=64)),
                  name="cbk", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()           # frees the replicas' CPUs for the other Ray tests


def _expected(model_dir, prompts) -> list:
    import torch

    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.models import load

    model, tok = load(model_dir, dtype="float32")
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64), tokenizer=tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [o.text for o in engine.generate(
            prompts, SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True))]
    finally:
        torch.set_num_threads(threads)


def test_serve_app_answers_openai_requests(url, model_dir):
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from transformers import AutoTokenizer

    status = serve.status().applications["cbk"]
    assert status.status == "RUNNING"
    replicas = status.deployments["cb_kernels"].replica_states
    assert replicas.get("RUNNING") == 2, replicas

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [" ".join(f"w{(13 * i + j) % 290 + 1}" for j in range(3 + i % 6)) for i in range(10)]
    chat = [{"role": "user", "content": "w20 w40"}]
    tok = AutoTokenizer.from_pretrained(model_dir)
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    want = _expected(model_dir, prompts + [chat_ids])
    body = dict(model=NAME, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})

    def complete(prompt):
        return client.completions.create(prompt=prompt, **body)

    with ThreadPoolExecutor(8) as pool:           # at once: both replicas' engines batch them
        answers = list(pool.map(complete, prompts))
    assert [a.choices[0].text for a in answers] == want[:-1]
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    assert all(a.usage.completion_tokens == MAX_TOKENS for a in answers)

    reply = client.chat.completions.create(messages=chat, **body)
    assert reply.choices[0].message.content == want[-1]

    pieces = client.completions.create(prompt=prompts[0], stream=True, **body)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want[0]

    with pytest.raises(openai.NotFoundError) as e:             # cb-kernels serve's error body
        client.completions.create(prompt="w1", model="other", max_tokens=2)
    assert "other" in e.value.body["message"]


def test_serve_app_checks_its_arguments():
    from cb_kernels import EngineConfig
    from cb_kernels.ray.serve_app import serve_app

    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        serve_app("m", replicas=0)
    with pytest.raises(ValueError, match="model must be a built-in name"):
        serve_app("")
    with pytest.raises(ValueError, match="device='cuda' needs num_gpus > 0"):
        serve_app("m", device="cuda")
    with pytest.raises(ValueError,
                       match="tensor parallelism inside a Ray Serve replica is not supported"):
        serve_app("m", engine_config=EngineConfig(tensor_parallel_size=2))
