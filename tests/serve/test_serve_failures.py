"""In-process servers (uvicorn on a thread). The server when the engine fails: a failed step is a 500 (streamed: an error event) for its
requests and the server keeps serving; an engine thread that dies answers every waiting client
and turns /health to 503. In-process (uvicorn on a thread), so the failures can be injected."""
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

if not os.environ.get("CBK_REQUIRE_SERVE_TESTS"):
    for _name in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(_name, reason="needs the serve extra: pip install -e '.[serve]'")

from tests.helpers import fail_nth_model_run, make_model, make_tokenizer  # noqa: E402


@pytest.fixture
def served(request):
    import uvicorn

    from cb_kernels import Engine, EngineConfig
    from cb_kernels.serve.routes import ServerConfig, create_app

    overlap = getattr(request, "param", "auto")
    engine = Engine(make_model("llama"), EngineConfig(num_blocks=64, block_size=16,
                                                      cpu_offload_gib=0, overlap=overlap),
                    tokenizer=make_tokenizer())
    app = create_app(engine, ServerConfig("tiny"))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def _post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_failed_step_is_a_500_and_the_server_goes_on(served, monkeypatch):
    engine, url = served
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    fail_nth_model_run(monkeypatch, engine.runner, 1)
    status, text = _post(url, body)
    err = json.loads(text)["error"]
    assert status == 500 and err["type"] == "server_error"
    assert "injected kernel failure" in err["message"]
    fail_nth_model_run(monkeypatch, engine.runner, 3)     # fails after two tokens were streamed
    status, text = _post(url, {**body, "stream": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert "injected kernel failure" in json.loads(events[-2])["error"]["message"]
    assert json.loads(events[0])["choices"][0]["finish_reason"] is None
    status, text = _post(url, body)
    assert status == 200 and len(json.loads(text)["choices"][0]["text"].split()) == 6
    assert _health(url)[1]["used_blocks"] == 0 and engine.stats()["failed_steps"] == 2


def test_a_dead_engine_thread_answers_everyone(served, monkeypatch):
    engine, url = served

    def broken_step():
        raise RuntimeError("the engine broke")

    monkeypatch.setattr(engine, "step", broken_step)
    status, text = _post(url, {"model": "tiny", "prompt": [5, 6], "max_tokens": 4})
    assert status == 500 and "the engine broke" in json.loads(text)["error"]["message"]
    status, health = _health(url)
    assert status == 503 and health["status"] == "failed" and "the engine broke" in health["error"]
    status, text = _post(url, {"model": "tiny", "prompt": [5, 6], "max_tokens": 4})
    assert status == 503 and json.loads(text)["error"]["code"] == "engine_failed"


@pytest.mark.parametrize("served", ["on"], indirect=True)
def test_overlap_pipeline_streams_and_cancels(served):
    """With overlap on (the GPU default; on a CPU it runs the same pipeline synchronously):
    streamed n=2 samples equal the non-streamed ones, and a hung-up stream frees its blocks."""
    import http.client

    engine, url = served
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0.9,
            "seed": 4, "n": 2, "logprobs": 1}
    status, text = _post(url, body)
    full = json.loads(text)["choices"]
    status, text = _post(url, {**body, "stream": True})
    got = {}
    for line in text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                got[c["index"]] = got.get(c["index"], "") + c["text"]
    assert got == {c["index"]: c["text"] for c in full}
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": [5, 6], "max_tokens": 900, "temperature": 0,
         "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read1(100)
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 10
    while _health(url)[1]["used_blocks"] or _health(url)[1]["running"]:
        assert time.monotonic() < deadline, _health(url)
        time.sleep(0.05)
    assert engine.stats()["overlapped_steps"] > 0
