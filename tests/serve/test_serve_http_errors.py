"""`cb-kernels serve` as a real process, when things go wrong: every kind of bad input gets an
OpenAI error naming the field, clients hanging up cancel their requests, a full queue answers 503
and SIGTERM drains; the command line's errors; `cb-kernels bench serve` against it. The server,
its model and the helpers are test_serve_http.py's (split from it by concern: that file checks
the answers).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serve.test_serve_http import (LONG_RUN, MAX_POSITIONS, NAME, ROOT,  # noqa: F401
                                         Server, _cancelled_count, _raw_request, model_dir,
                                         openai, server)


# -- bad input -------------------------------------------------------------------------------------
LONG = [5] * (MAX_POSITIONS + 1)
BAD = [
    ("completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("completions", b'[1, 2]', 400, None),
    ("completions", b'\xff\xfe', 400, None),
    ("completions", {"prompt": "w1"}, 400, "model"),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [[1], []]}, 400, "prompt[1]"),
    ("completions", {"model": "tiny", "prompt": [1, 999]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, -2]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "w1", "max_tokens": 5.5}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "w1", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "w1", "temperature": 1e-9}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": "w1", "n": 0}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "w1", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "w1", "seed": -1}, 400, "seed"),
    ("completions", {"model": "tiny", "prompt": "w1", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": "tiny", "prompt": "w1", "stop": ""}, 400, "stop"),
    ("completions", {"model": "tiny", "prompt": "w1", "stop": ["a", 5]}, 400, "stop"),
    ("completions", {"model": "tiny", "prompt": "w1", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "w1", "logit_bias": {"9999": 1}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "w1", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "w1", "stop_token_ids": [9999]}, 400,
     "stop_token_ids"),
    ("completions", {"model": "tiny", "prompt": "w1", "min_tokens": 9, "max_tokens": 3}, 400,
     "min_tokens"),
    ("completions", {"model": "tiny", "prompt": "w1", "max_token": 3}, 400, "max_token"),
    ("completions", {"model": "tiny", "prompt": "w1", "echo": True}, 400, "echo"),
    ("completions", {"model": "tiny", "prompt": LONG}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5] * 8000, "max_tokens": 500}, 400, "max_tokens"),
    ("completions", {"model": "other", "prompt": "w1"}, 404, "model"),
    ("chat/completions", {"model": "tiny"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "bot", "content": "w1"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": [{"content": "w1"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": ["w1"]}, 400, "messages[0]"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                          "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                          "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5 " * MAX_POSITIONS}]},
     400, "messages"),
    ("chat/completions", {"model": "other", "messages": [{"role": "user", "content": "w1"}]}, 404,
     "model"),
]


def test_every_bad_input_gets_an_openai_error_naming_the_field(server):
    for endpoint, body, status, param in BAD:
        got, reply, _ = server.post("/v1/" + endpoint, body)
        assert got == status, (body, reply)
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], reply
        assert err["param"] == param, (body, err)
        if param is not None:
            assert param.split("[")[0].split(".")[0] in err["message"], err
    assert server.post("/v1/nowhere", {})[0] == 404
    assert server.get("/v1/completions")[0] == 405
    # The openai client surfaces the same bodies.
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt="w1", max_tokens=10, top_p=2)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                        "content": "w1"}])
    h = server.wait_idle()
    assert h["status"] == "ok"
    r = server.client.completions.create(model=NAME, prompt=[5, 6], max_tokens=2, temperature=0)
    assert len(r.choices[0].text.split()) == 2     # still serving


# -- clients that leave ----------------------------------------------------------------------------
def test_client_hanging_up_cancels_its_request(server):
    before = _cancelled_count(server)
    long = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": LONG_RUN, "temperature": 0,
            "ignore_eos": True}
    # Streaming: read two chunks, hang up.
    conn = _raw_request(server, "/v1/completions", {**long, "stream": True})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    got = b""
    while got.count(b"data: ") < 2:
        got += resp.read1(4096)
    assert server.health()["running"] == 1
    conn.sock.shutdown(2)
    conn.close()
    h = server.wait_idle(10)
    assert h["used_blocks"] == 0
    # Non-streaming: hang up while it runs.
    conn = _raw_request(server, "/v1/chat/completions",
                        {**{k: v for k, v in long.items() if k != "prompt"},
                         "messages": [{"role": "user", "content": "w5"}]})
    deadline = time.monotonic() + 10
    while server.health()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.sock.shutdown(2)
    conn.close()
    server.wait_idle(10)
    deadline = time.monotonic() + 5
    while _cancelled_count(server) < before + 2:
        assert time.monotonic() < deadline, "the requests were not cancelled"
        time.sleep(0.05)
    # The openai client closing a stream early does the same.
    stream = server.client.completions.create(model=NAME, prompt=[8, 9], max_tokens=LONG_RUN,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    server.wait_idle(10)


# -- a full queue and SIGTERM ---------------------------------------------------------------------
def test_full_queue_503_then_sigterm_drains(model_dir, tmp_path, server):
    """max_num_seqs 2, max_waiting 1: A1 and A2 run (thousands of tokens each), B waits, C gets
    503. SIGTERM: no new connection; A2's client leaves, so B runs and finishes whole during the
    drain; A1 is cancelled at the drain deadline ("cancelled"); exit status 0, no block held."""
    want_b = server.client.completions.create(model=NAME, prompt=[20, 21], max_tokens=30,
                                              temperature=0).choices[0].text
    want_a = server.client.completions.create(model=NAME, prompt=[30, 31], max_tokens=100,
                                              temperature=0).choices[0].text.split()
    s = Server(model_dir, tmp_path / "server2.log", "--max-num-seqs", "2", "--max-waiting", "1",
               "--drain-timeout", "3")
    try:
        def stream(prompt):       # ~8000 tokens: seconds, far past the 3 s drain deadline
            return s.client.completions.create(model=NAME, prompt=prompt, max_tokens=LONG_RUN,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
        a1 = stream([30, 31])
        a1_text = next(a1).choices[0].text
        a2 = stream([40, 41])
        next(a2)
        b_result = {}
        b = threading.Thread(target=lambda: b_result.update(r=s.client.completions.create(
            model=NAME, prompt=[20, 21], max_tokens=30, temperature=0)))
        b.start()
        deadline = time.monotonic() + 10
        while s.health()["queued"] != 1:
            assert time.monotonic() < deadline, s.health()
            time.sleep(0.01)
        status, body, headers = s.post("/v1/completions", {"model": NAME, "prompt": "w1"})
        assert status == 503 and headers["Retry-After"] == "1"
        assert body["error"]["code"] == "queue_full"
        status, body, _ = s.post("/v1/completions", {"model": NAME, "prompt": [[1], [2]]})
        assert status == 400 and body["error"]["param"] == "prompt"     # > max_waiting: never fits
        assert "--max-waiting" in body["error"]["message"]
        text = s.get("/metrics")[1]
        assert 'cb_kernels_requests_rejected_total{model_name="tiny"} 1.0' in text
        assert s.health()["running"] == 2

        s.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while True:      # the listening socket closes
            try:
                urllib.request.urlopen(s.url + "/health", timeout=5)
            except urllib.error.HTTPError as e:
                assert e.code == 503      # draining, on a connection made before the close
            except (urllib.error.URLError, ConnectionError):
                break
            assert time.monotonic() < signalled + 10, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        a2.close()                        # its client leaves: B gets the slot
        b.join(30)
        assert b_result["r"].choices[0].text == want_b
        assert b_result["r"].choices[0].finish_reason == "length"
        chunks = list(a1)                 # A1 runs until the drain deadline
        a1_text += "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "cancelled"
        assert time.monotonic() - signalled >= 2.5
        n = len(a1_text.split())
        assert 100 < n < LONG_RUN and a1_text.split()[:100] == want_a
        assert s.proc.wait(30) == 0
        log = s.output()
        assert "engine stopped: 0 requests left, 0 KV blocks used" in log, log
    finally:
        s.stop()


def test_serve_command_line_errors(model_dir):
    import socket

    from cb_kernels import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            cli.main(["serve", "--model", str(model_dir), "--port", str(port)])
    with pytest.raises(SystemExit, match="--max-waiting must be >= 1"):
        cli.main(["serve", "--model", str(model_dir), "--max-waiting", "0"])
    with pytest.raises(SystemExit, match="--model no-such-model: "):
        cli.main(["serve", "--model", "no-such-model", "--port", "0"])
    with pytest.raises(SystemExit, match="bad option: max_num_seqs must be >= 1"):
        cli.main(["serve", "--model", str(model_dir), "--max-num-seqs", "0", "--port", "0"])


def test_bench_serve_runs_against_cb_kernels(model_dir, tmp_path):
    """`cb-kernels bench serve`, shortest form: one server, two rates, a JSON report and a plot."""
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "cb_kernels", "bench", "serve", "--model",
                        str(model_dir), "--servers", "cb_kernels", "--rates", "50,inf",
                        "--num-requests", "4", "--max-tokens", "4", "--dtype", "float32",
                        "--json", str(out), "--plot", str(png)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["server"] == "cb_kernels" and [row["rate"] for row in result["rows"]] == [50, "inf"]
    for row in result["rows"]:
        assert row["ok"] == 4 and row["output_tokens"] == 16 and row["errors"] == []
        assert row["throughput_tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    assert png.stat().st_size > 0 and "| cb_kernels | inf | 4/4 |" in r.stdout


def test_serve_burst_runs_the_burst_through_the_engine(model_dir, tmp_path):
    """bench/serve_burst.py, shortest form: two budgets on the tiny model, figures that add up."""
    out = tmp_path / "burst.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_burst.py"), "--model",
                        str(model_dir), "--dtype", "float32", "--max-batch-tokens", "16,auto",
                        "--requests", "6", "--input-len", "10", "--output-len", "3",
                        "--repeats", "1", "--json", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["max_batch_tokens"] for row in rows] == [16, 2048]
    small, auto = rows[0]["best"], rows[1]["best"]
    # 60 prompt tokens: 16 a step (decodes first) takes >= 4 steps that prefill; 2048 takes one
    assert small["prefill_steps"] >= 4 and auto["prefill_steps"] == 1
    assert small["steps"] > auto["steps"] >= 3
    for b in (small, auto):
        assert b["output_tok_s"] > 0 and 0 < b["ttft_mean_ms"] <= b["ttft_p99_ms"]
    assert "| 16 |" in r.stdout and rows[0]["vs_first"]["output_tok_s"] == 1.0
