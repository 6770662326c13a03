"""`cb-kernels serve --enable-rl-endpoints` (issue 27) as a real process on 127.0.0.1, over raw
HTTP: vLLM's RL routes (sleep / wake_up, pause / resume, update_weights from a safetensors folder,
reset_prefix_cache, weight_info, get_world_size), answers equal transformers' greedy tokens after
a weight push, and every bad value refused with the field named. Off by default."""
from __future__ import annotations

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
    assert server.call("POST", "/reset_prefix_cache") == (200, {})
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
