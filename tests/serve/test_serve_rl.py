"""`cb-kernels serve --enable-rl-endpoints` (issue 27) as a real process on 127.0.0.1, over raw
HTTP: vLLM's RL routes (sleep / wake_up, pause / resume, update_weights from a safetensors folder,
reset_prefix_cache, weight_info, get_world_size), answers equal transformers' greedy tokens after
a weight push, and every bad value refused with the field named. Off by default."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

if os.environ.get("CBK_REQUIRE_SERVE_TESTS"):     # .ci/run sets it: a missing extra fails there
    import fastapi, uvicorn  # noqa: E401, F401
else:
    for _name in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(_name, reason="needs the serve extra: pip install -e '.[serve]'")

from tests.helpers import VOCAB, make_tokenizer, reference_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The served checkpoint (seed 0) and a weight folder of other weights (seed 1)."""
    served, pushed = tmp_path_factory.mktemp("rl_model"), tmp_path_factory.mktemp("rl_push")
    _model(0).save_pretrained(served, safe_serialization=True)
    make_tokenizer().save_pretrained(served)
    _model(1).save_pretrained(pushed, safe_serialization=True)
    return served, pushed


class Server:
    def __init__(self, model_dir, log: Path, *extra):
        cmd = [sys.executable, "-m", "cb_kernels", "serve", "--model", str(model_dir),
               "--served-model-name", "tiny", "--port", "0", "--dtype", "float32",
               "--block-size", "16", "--num-blocks", "600", "--cpu-offload-gib", "0", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(log, "wb"))
        deadline = time.monotonic() + 90
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+) \(ready\)",
                                  log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{m.group(1)}"

    def call(self, method: str, path: str, body=None) -> tuple:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def complete(self, prompt, max_tokens=6, **kw) -> dict:
        status, body = self.call("POST", "/v1/completions",
                                 {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                  "temperature": 0, **kw})
        assert status == 200, body
        return body

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    s = Server(dirs[0], tmp_path_factory.mktemp("rl_log") / "server.log",
               "--enable-rl-endpoints")
    yield s
    s.stop()


def _words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


PROMPT = [5, 17, 42, 99, 7, 300, 12]


def test_rl_routes_are_off_by_default():
    from cb_kernels import Engine, EngineConfig
    from cb_kernels.serve.routes import ServerConfig, create_app

    engine = Engine(_model(0), EngineConfig(block_size=8, num_blocks=32))
    paths = lambda app: {getattr(r, "path", None) for r in app.routes}   # noqa: E731
    assert "/sleep" not in paths(create_app(engine, ServerConfig("tiny")))
    on = paths(create_app(engine, ServerConfig("tiny", enable_rl_endpoints=True)))
    assert {"/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
            "/reset_prefix_cache", "/update_weights", "/weight_info", "/get_world_size"} <= on


def test_sleep_wake_and_state_routes(server):
    assert server.call("GET", "/get_world_size") == (200, {"world_size": 1})
    status, info = server.call("GET", "/weight_info")
    assert status == 200 and info["dtype"] == "float32" and info["num_parameters"] > 0
    want = _words(reference_tokens(_model(0), [PROMPT], 6)[0])
    assert server.complete(PROMPT)["choices"][0]["text"].strip() == want
    status, body = server.call("POST", "/sleep?level=2")
    assert status == 200 and body["bytes_freed"] > 0
    assert server.call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert server.call("POST", "/wake_up?tags=kv_cache") == (200, {})
    assert server.call("GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert server.call("POST", "/wake_up") == (200, {})
    assert server.call("GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert server.call("POST", "/reset_prefix_cache") == (200, {"success": True})
    assert server.complete(PROMPT)["choices"][0]["text"].strip() == want


def test_pause_abort_ends_a_running_request_and_resume(server):
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        body=server.complete(PROMPT, max_tokens=3000, ignore_eos=True)))
    worker.start()
    deadline = time.monotonic() + 30
    while json.loads(urllib.request.urlopen(server.url + "/health").read())["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.call("POST", "/pause?mode=abort") == (200, {})
    worker.join(30)
    choice = result["body"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["text"].split()) < 3000
    assert server.call("GET", "/is_paused") == (200, {"is_paused": True})
    assert server.call("POST", "/resume") == (200, {})
    assert server.call("GET", "/is_paused") == (200, {"is_paused": False})


def test_update_weights_from_a_safetensors_folder(server, dirs, tmp_path):
    status, body = server.call("POST", "/update_weights", {"weight_dir": str(dirs[1])})
    assert status == 200 and body["weight_version"] >= 1
    assert server.call("GET", "/weight_info")[1]["weight_version"] == body["weight_version"]
    want = _words(reference_tokens(_model(1), [PROMPT], 6)[0])
    assert server.complete(PROMPT)["choices"][0]["text"].strip() == want
    # refused, with the problem named
    (tmp_path / "pickled").mkdir()
    torch.save({}, tmp_path / "pickled" / "pytorch_model.bin")
    for body, match in [({"weight_dir": str(tmp_path / "nope")}, "is not a folder"),
                        ({"weight_dir": str(tmp_path / "pickled")},
                         "only pickle weights, refused: pytorch_model.bin"),
                        ({"weight_dir": str(dirs[1]), "x": 1}, "takes {\"weight_dir\": DIR}"),
                        ({}, "takes {\"weight_dir\": DIR}")]:
        status, err = server.call("POST", "/update_weights", body)
        assert status == 400 and match in err["error"]["message"], err
    partial = tmp_path / "partial"
    partial.mkdir()
    from safetensors.torch import save_file
    save_file({"model.norm.weight": torch.ones(64)}, str(partial / "model.safetensors"))
    status, err = server.call("POST", "/update_weights", {"weight_dir": str(partial)})
    assert status == 400 and "lacks" in err["error"]["message"]


def test_bad_values_are_refused(server):
    status, err = server.call("POST", "/sleep?level=3")
    assert status == 400 and "sleep level must be 1 or 2" in err["error"]["message"]
    status, err = server.call("POST", "/pause?mode=drain")
    assert status == 400 and "pause mode must be" in err["error"]["message"]
    status, err = server.call("POST", "/wake_up?tags=kv")
    assert status == 400 and "wake_up tags" in err["error"]["message"]
    assert server.call("GET", "/is_paused") == (200, {"is_paused": False})


# -- /v1/completions as RL clients call it (TRL's VLLMClient: tests/serve/test_serve_trl.py) ------
def _sse(server, body) -> list:
    req = urllib.request.Request(server.url + "/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _served(server):
    """The model the server now holds: seed 0, or seed 1 once a test pushed those weights."""
    return _model(1 if server.call("GET", "/weight_info")[1]["weight_version"] else 0)


def test_token_id_prompts_answer_with_token_ids(server):
    prompts = [PROMPT, [3, 1, 4, 1, 5]]
    want = reference_tokens(_served(server), prompts, 5)
    body = server.complete(prompts, max_tokens=5, n=2, logprobs=0, return_token_ids=True,
                           return_tokens_as_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]          # prompt-major, n each
    for c in choices:
        i = c["index"] // 2
        assert c["prompt_token_ids"] == prompts[i]
        assert c["token_ids"] == want[i]                          # greedy: both samples agree
        assert c["text"].strip() == _words(want[i])
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in want[i]]
        assert len(c["logprobs"]["token_logprobs"]) == 5
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
    # off by default: no id fields, logprob tokens as text
    plain = server.complete(prompts[1], max_tokens=5, logprobs=0)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    assert plain["logprobs"]["tokens"] == [make_tokenizer().decode([t]) for t in want[1]]
    # streamed: the prompt ids in each choice's first chunk, the new ids in every chunk
    chunks = _sse(server, {"model": "tiny", "prompt": prompts, "max_tokens": 5,
                           "temperature": 0, "return_token_ids": True})
    got = {0: [], 1: []}
    firsts = {}
    for ch in chunks:
        for c in ch["choices"]:
            got[c["index"]] += c["token_ids"]
            if "prompt_token_ids" in c:
                assert c["index"] not in firsts
                firsts[c["index"]] = c["prompt_token_ids"]
    assert got == {0: want[0], 1: want[1]} and firsts == {0: prompts[0], 1: prompts[1]}


def test_sampling_fields_rl_clients_send(server):
    """repetition_penalty, min_p, top_k as TRL sends them act on the tokens (seeded)."""
    base = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    ids = lambda **kw: server.complete(PROMPT, **{**base, **kw})["choices"][0]["token_ids"]  # noqa: E731
    plain = ids()
    assert ids(top_k=0, min_p=0.0, repetition_penalty=1.0) == plain     # TRL's "off" values
    assert ids(top_k=-1) == plain
    greedy = reference_tokens(_served(server), [PROMPT], 8)[0]
    assert ids(top_k=1) == greedy                        # top_k 1 is greedy at any temperature
    assert ids(min_p=1.0) == greedy                      # only the most likely token passes
    penalized = ids(temperature=0, repetition_penalty=1e6)
    assert len(set(penalized)) == len(penalized)         # no id repeats under a huge penalty


@pytest.mark.parametrize("prompt,param,match", [
    ([1, "w2"], "prompt", "must be a string, a list of strings, a list of token ids"),
    ([[1], 2], "prompt", "must be a string, a list of strings, a list of token ids"),
    ([[1], ["w1"]], "prompt", "must be a string, a list of strings, a list of token ids"),
    ([1, 2.0], "prompt", "must be a string"),
    ([True, 2], "prompt", "must be a string"),
    ([[]], "prompt[0]", "empty list of token ids"),
    ([[1, 2], []], "prompt[1]", "empty list of token ids"),
    ([], "prompt", "empty list"),
    ([1, VOCAB], "prompt", str(VOCAB)),
    ([[1, 2], [3, -1]], "prompt[1]", "-1"),
    ([[4], [1, 10 ** 30]], "prompt[1]", "vocab"),
])
def test_bad_token_id_prompts_are_refused(server, prompt, param, match):
    status, err = server.call("POST", "/v1/completions",
                              {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == param, err
    assert match in err["error"]["message"], err


def test_unknown_fields_stay_refused(server):
    for field in ("return_token_id", "prompt_logprobs", "structured_outputs"):
        status, err = server.call("POST", "/v1/completions",
                                  {"model": "tiny", "prompt": PROMPT, field: True})
        assert status == 400 and err["error"]["param"] == field, err


def test_reset_prefix_cache_takes_a_bare_post_only_there(server):
    """TRL posts /reset_prefix_cache with no body and no Content-Type; every other POST still
    needs application/json (guard.Guard: CSRF)."""
    def bare(path):          # http.client sends Content-Length: 0 and no Content-Type
        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
        try:
            conn.request("POST", path)
            return conn.getresponse().status
        finally:
            conn.close()
    assert bare("/reset_prefix_cache") == 200
    assert bare("/resume") == 415 and bare("/pause") == 415
