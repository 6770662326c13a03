"""`cb-kernels serve` probed as a hostile or careless client would (issue #28), as a real process
on 127.0.0.1: client-supplied template options, oversized bodies and prompts, work that would
stall the event loop, fan-out, clients that stop reading, access control and strict JSON. Each
test reproduces a defect the server had and checks the fix's behaviour."""
from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import pytest

from tests.serve.test_serve_http import NAME, Server, model_dir, openai  # noqa: F401

API_KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):      # noqa: F811
    s = Server(model_dir, tmp_path_factory.mktemp("hard_log") / "server.log",
               "--max-num-seqs", "32", "--max-batch-tokens", "256")
    yield s
    s.stop()


def raw(server, method: str, path: str, body: bytes = b"", headers=None) -> tuple:
    """(status, parsed JSON body or text, headers) of one raw HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        data = json.loads(data)
    except ValueError:
        data = data.decode(errors="replace")
    return r.status, data, r.headers


def chat(**extra) -> bytes:
    return json.dumps({"model": NAME, "messages": [{"role": "user", "content": "w5 w6"}],
                       "max_tokens": 2, "temperature": 0, **extra}).encode()


# -- 1. chat_template_kwargs carries template variables only -----------------------------------
@pytest.mark.parametrize("key, value", [
    ("chat_template", "{% for i in range(15000) %}{% for j in range(15000) %}{{ i }}"
                      "{% endfor %}{% endfor %}"),
    ("padding", "max_length"), ("max_length", 30000000), ("truncation", True),
    ("tokenize", False), ("return_tensors", "pt"), ("return_dict", True),
    ("tokenizer_kwargs", {"padding": "max_length"})])
def test_template_and_tokenizer_options_are_refused_by_name(server, key, value):
    status, body, _ = raw(server, "POST", "/v1/chat/completions",
                          chat(chat_template_kwargs={key: value}))
    assert status == 400, body
    assert body["error"]["param"] == f"chat_template_kwargs.{key}", body
    assert "template variables only" in body["error"]["message"]


def test_template_variables_still_reach_the_template(server):
    status, body, _ = raw(server, "POST", "/v1/chat/completions",
                          chat(chat_template_kwargs={"enable_thinking": False}))
    assert status == 200, body
    assert len(body["choices"][0]["message"]["content"].split()) == 2


# -- 2. size caps, and no tokenizing or body building on the event loop ------------------------
@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):      # noqa: F811
    """Two sequences at once, eight waiting, 64 KiB bodies, 4-chunk stream buffers, 2 s for a
    client that reads nothing or sends its head slowly, 1 s keep-alive."""
    s = Server(model_dir, tmp_path_factory.mktemp("small_log") / "server.log",
               "--max-num-seqs", "2", "--max-waiting", "8", "--max-request-bytes", "65536",
               "--stream-buffer", "4", "--stream-stall-timeout", "2",
               "--request-head-timeout", "2", "--timeout-keep-alive", "1")
    yield s
    s.stop()


def test_bodies_over_the_cap_are_413_before_they_are_read(small):
    big = chat(user="x" * 70000)
    status, body, _ = raw(small, "POST", "/v1/chat/completions", big)     # Content-Length
    assert status == 413 and "65536" in body["error"]["message"], body
    # Chunked (no Content-Length): refused once the bytes read pass the cap.
    conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", iter([big[i:i + 8192]
                                                        for i in range(0, len(big), 8192)]),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and "--max-request-bytes" in json.loads(r.read())["error"]["message"]
    conn.close()
    assert raw(small, "POST", "/v1/chat/completions", chat())[0] == 200


def test_text_longer_than_the_context_is_refused_before_tokenizing(server):
    # "w5 " x 20000: 60,000 characters; no token of the word vocabulary spells more than 5
    # ("<unk>"), and the model takes 8192 positions: at most 40,960 characters can fit.
    text = "w5 " * 20000
    status, body, _ = raw(server, "POST", "/v1/completions",
                          json.dumps({"model": NAME, "prompt": text, "max_tokens": 1}).encode())
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "60000 characters" in body["error"]["message"] and "40960" in body["error"]["message"]
    status, body, _ = raw(server, "POST", "/v1/chat/completions", json.dumps({
        "model": NAME, "messages": [{"role": "user", "content": text}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages", body


def test_health_answers_while_a_large_body_is_built(server):
    """n=16 x 1500 tokens x 20 top logprobs, not streamed: ~480,000 token strings to format
    after the engine finished. /health, polled meanwhile, keeps answering (the engine idle)
    before the big answer's headers arrive; on the event loop it got at most one answer."""
    done = {}

    def big():
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": NAME, "prompt": [5, 6, 7], "n": 16, "max_tokens": 1500, "logprobs": 20,
            "temperature": 1.0, "seed": 1, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        done["headers"] = time.monotonic()
        done["status"] = r.status
        done["choices"] = len(json.loads(r.read())["choices"])
        conn.close()

    thread = threading.Thread(target=big)
    thread.start()
    polls, ran = [], False
    while thread.is_alive():
        h = server.health()
        at = time.monotonic()
        ran = ran or h["running"] > 0
        if ran:
            polls.append((at, h["running"] + h["waiting"] + h["queued"] + h["used_blocks"]))
        time.sleep(0.01)
    thread.join()
    assert done["status"] == 200 and done["choices"] == 16
    idle_before_answer = [at for at, busy in polls if busy == 0 and at < done["headers"]]
    assert len(idle_before_answer) >= 3, (len(idle_before_answer), len(polls))


# -- 3. fan-out ---------------------------------------------------------------------------------
def test_prompts_times_n_is_capped(server):
    body = {"model": NAME, "prompt": [[5, 6]] * 4, "n": 100, "max_tokens": 1}
    status, reply, _ = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["code"] == "too_many_sequences", reply
    assert "4 prompts x n=100 = 400 sequences" in reply["error"]["message"]
    assert "--max-request-seqs" in reply["error"]["message"]
    body = {"model": NAME, "prompt": [[5, 6]] * 2, "n": 128, "max_tokens": 8000}
    status, reply, _ = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    assert "--max-request-tokens" in reply["error"]["message"]


def _stream_open(s, body: dict, rcvbuf: int = 0) -> socket.socket:
    """A raw streamed POST whose answer is not read."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", s.port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)
    return sock


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_waiting_counts_sequences_not_requests(small):
    """--max-num-seqs 2, --max-waiting 8: two long streams run; a request of n=5 waits (5
    sequences); one of n=4 more is 503 (9 > 8), though it is only the second request waiting;
    n=9 alone can never be admitted: 400 naming --max-waiting."""
    long = {"model": NAME, "prompt": [5, 6], "max_tokens": 8000, "ignore_eos": True}
    runners = [_stream_open(small, long) for _ in range(2)]
    _wait(lambda: small.health()["running"] == 2, 30, "the two streams do not run")
    waiter = _stream_open(small, {**long, "n": 5, "max_tokens": 3})
    _wait(lambda: small.health()["queued"] == 5, 30, "n=5 is not counted as 5 waiting")
    status, body, headers = raw(small, "POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": [5], "n": 4, "max_tokens": 2}).encode())
    assert status == 503 and headers["Retry-After"], body
    status, body, _ = raw(small, "POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": [5], "n": 9, "max_tokens": 2}).encode())
    assert status == 400 and "--max-waiting" in body["error"]["message"], body
    for sock in runners + [waiter]:
        sock.close()
    small.wait_idle(30)


# -- 4. clients that stop reading ---------------------------------------------------------------
def test_a_client_that_stops_reading_is_cancelled_and_its_blocks_come_back(small):
    """A stream with 20 top logprobs a token (kilobytes a chunk) into a 4 KiB receive buffer
    nobody reads: after --stream-stall-timeout (2 s) its request ends "cancelled", not after
    its 8000 tokens, and the engine holds no block."""
    from tests.serve.test_serve_http import _cancelled_count

    before = _cancelled_count(small)
    sock = _stream_open(small, {"model": NAME, "prompt": [5, 6], "max_tokens": 8000,
                                "ignore_eos": True, "logprobs": 20}, rcvbuf=4096)
    _wait(lambda: small.health()["running"] == 1, 30, "the stream does not run")
    _wait(lambda: _cancelled_count(small) == before + 1, 60, "the stalled stream was not cancelled")
    h = small.wait_idle(10)
    assert h["used_blocks"] == 0
    assert "read nothing for 2 s" in small.output()
    sock.close()
    assert raw(small, "POST", "/v1/chat/completions", chat())[0] == 200


# -- 5. access control --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):      # noqa: F811
    """The key from CBK_API_KEY (no flag); /health and /metrics stay open."""
    old = os.environ.get("CBK_API_KEY")
    os.environ["CBK_API_KEY"] = API_KEY
    try:
        s = Server(model_dir, tmp_path_factory.mktemp("keyed_log") / "server.log")
    finally:
        if old is None:
            del os.environ["CBK_API_KEY"]
        else:
            os.environ["CBK_API_KEY"] = old
    yield s
    s.stop()


def test_api_key_guards_every_v1_route(keyed):
    for method, path, body in (("GET", "/v1/models", b""), ("GET", f"/v1/models/{NAME}", b""),
                               ("POST", "/v1/completions", json.dumps(
                                   {"model": NAME, "prompt": [5], "max_tokens": 1}).encode()),
                               ("POST", "/v1/chat/completions", chat())):
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                     {"Authorization": f"Basic {API_KEY}"}):
            status, reply, headers = raw(keyed, method, path, body, auth)
            assert status == 401, (path, auth, reply)
            assert reply["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"]
        status, reply, _ = raw(keyed, method, path, body, {"Authorization": f"Bearer {API_KEY}"})
        assert status == 200, (path, reply)
    assert raw(keyed, "GET", "/health")[0] == 200 and raw(keyed, "GET", "/metrics")[0] == 200
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=NAME, prompt=[5, 6], max_tokens=2).usage
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_protect_metrics_closes_health_and_metrics_too(model_dir, tmp_path):  # noqa: F811
    s = Server(model_dir, tmp_path / "server.log", "--api-key", API_KEY, "--protect-metrics")
    try:
        for path in ("/health", "/metrics"):
            assert raw(s, "GET", path)[0] == 401
            assert raw(s, "GET", path, headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200
    finally:
        s.stop()


def test_posts_must_be_json_and_hosts_must_be_ours(server):
    body = json.dumps({"model": NAME, "prompt": [5], "max_tokens": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                  ""):
        status, reply, _ = raw(server, "POST", "/v1/completions", body, {"Content-Type": ctype})
        assert status == 415 and reply["error"]["code"] == "unsupported_media_type", ctype
    assert raw(server, "POST", "/v1/completions", body,
               {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    for host in ("evil.example", "evil.example:8000", "127.0.0.2"):      # DNS rebinding
        status, reply, _ = raw(server, "GET", "/v1/models", headers={"Host": host})
        assert status == 421 and reply["error"]["code"] == "misdirected_request", host
    for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}"):
        assert raw(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_served_model_name_defaults_to_the_folder_name():
    from cb_kernels.serve.server import allowed_hosts, is_loopback, served_name

    assert served_name("/home/me/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_name("smollm2-135m") == "smollm2-135m"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    assert allowed_hosts(None, True) == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts(None, False) is None and allowed_hosts("*", True) is None
    assert allowed_hosts("a.example, ::1", False) == ("a.example", "[::1]")


def test_default_name_and_open_host_warning(model_dir, tmp_path):  # noqa: F811
    """No --served-model-name: the folder's name (its path is nowhere in an answer); a
    non-loopback --host without a key logs a warning."""
    import re
    import subprocess
    import sys

    from tests.serve.test_serve_http import ROOT

    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("CBK_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "cb_kernels", "serve", "--model",
                             str(model_dir), "--host", "0.0.0.0", "--port", "0", "--dtype",
                             "float32", "--num-blocks", "64", "--allowed-hosts", "127.0.0.1"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        _wait(lambda: "(ready)" in log.read_text() or proc.poll() is not None, 90, "no start")
        text = log.read_text()
        port = int(re.search(r"on http://0\.0\.0\.0:(\d+) \(ready\)", text).group(1))
        assert "not a loopback address, with no API key" in text
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models/nope")
        r = conn.getresponse()
        reply = r.read().decode()
        assert r.status == 404 and repr(model_dir.name) in reply and str(model_dir) not in reply
    finally:
        proc.terminate()
        proc.wait(30)


# -- 6. strict JSON -----------------------------------------------------------------------------
def test_duplicate_keys_and_non_canonical_logit_bias_are_refused(server):
    status, reply, _ = raw(server, "POST", "/v1/completions",
                           b'{"model": "tiny", "prompt": [5], "max_tokens": 1, "max_tokens": 900}')
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    assert "twice" in reply["error"]["message"]
    status, reply, _ = raw(server, "POST", "/v1/chat/completions",
                           b'{"model": "tiny", "messages": [{"role": "user", "content": "w5",'
                           b' "role": "system"}]}')
    assert status == 400 and reply["error"]["param"] == "role", reply
    for key in (" 5 ", "1_0", "+5", "05", "\u0665"):
        status, reply, _ = raw(server, "POST", "/v1/completions", json.dumps(
            {"model": NAME, "prompt": [5], "max_tokens": 1, "logit_bias": {key: 1}}).encode())
        assert status == 400 and reply["error"]["param"] == "logit_bias", (key, reply)
        assert "decimal integers" in reply["error"]["message"]
    assert raw(server, "POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": [5], "max_tokens": 1, "logit_bias": {"5": 1, "0": 2}}).encode()
    )[0] == 200


def test_slow_heads_and_huge_heads_are_cut_off(small):
    """--request-head-timeout 2: a client dripping a header byte every 0.2 s is disconnected
    (uvicorn alone kept it for ever); a 20 KB head is 431 (--max-header-bytes 16384), 400 while
    it is incomplete (h11's limit); an idle
    keep-alive connection closes after --timeout-keep-alive (1 s)."""
    sock = socket.create_connection(("127.0.0.1", small.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    sock.settimeout(0.2)
    start, closed = time.monotonic(), False
    while time.monotonic() - start < 20:
        try:
            sock.sendall(b"X")
            if sock.recv(1024) == b"":
                closed = True
                break
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
    sock.close()
    assert closed and time.monotonic() - start < 10, "the dripping client was not cut off"
    status, reply, _ = raw(small, "GET", "/v1/models", headers={"X-Big": "y" * 20000})
    assert status == 431 and reply["error"]["code"] == "headers_too_large", reply
    sock = socket.create_connection(("127.0.0.1", small.port))      # a head that never ends
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"y" * 20000)
    sock.settimeout(10)
    assert sock.recv(1024).startswith(b"HTTP/1.1 400")
    sock.close()
    conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    time.sleep(2)
    assert conn.sock.recv(1) == b""        # closed by the server
    conn.close()


# -- soak -----------------------------------------------------------------------------------------
def test_soak_3000_mixed_requests_keeps_rss_flat(tmp_path):
    """bench/soak_serve.py: 3,000 requests of ten kinds (answers, streams, hang-ups, bad bodies);
    each gets its expected status, the server's RSS grows under 50 MiB after 500 warm-up
    requests, and no KV block is left."""
    import subprocess
    import sys

    from tests.serve.test_serve_http import ROOT

    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "soak_serve.py"), "--requests",
                        "3000", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    expected = {"chat 200", "stream 200", "stream_hangup 200", "wait_hangup hung up",
                "bad_json 400", "duplicate_key 400", "text_plain 415", "too_big 413",
                "template_option 400", "logprobs 200"}
    assert result["counts"] == {k: 300 for k in expected}, result["counts"]
    assert result["rss_growth_mib"] < 50 and result["used_blocks_end"] == 0, result


def test_a_stream_past_its_buffer_is_paused_and_its_tokens_coalesced():
    """EngineLoop's dispatch, driven by hand: while a stream's queue holds --stream-buffer
    chunks, its tokens stay in the engine's Sequence; the next chunk carries them all."""
    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.serve.engine_loop import EngineLoop, Ticket
    from tests.helpers import make_model, make_tokenizer

    class Queue:              # what the HTTP side has not read yet
        size = 0

        def qsize(self):
            return self.size

    class AioLoop:            # what the engine thread hands over
        def __init__(self):
            self.items = []

        def call_soon_threadsafe(self, fn, items):
            self.items.extend(item for _, item in items)

    engine = Engine(make_model("llama"), EngineConfig(num_blocks=64, block_size=8,
                                                      cpu_offload_gib=0),
                    tokenizer=make_tokenizer())
    loop = EngineLoop(engine, stream_buffer=2)
    ticket = Ticket("r", [5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), True,
                    aio_loop=AioLoop(), queue=Queue())
    loop._add(ticket)

    def step():
        loop._dispatch({o.request_id: o for o in engine.step()})
        got, ticket.aio_loop.items = ticket.aio_loop.items, []
        return [(kind, len(item.outputs[0].token_ids)) for kind, _, item in got]

    assert step() == [("delta", 1)]
    ticket.queue.size = 2                        # the client reads nothing: paused
    assert step() == [] and step() == []
    ticket.queue.size = 1                        # it read one: the 2 tokens held come at once
    assert step() == [("delta", 3)]
    ticket.queue.size = 2
    assert step() == []
    assert step() == [("delta", 2), ("final", 6)]    # the end is never held back


def test_limit_flags_are_checked(model_dir):      # noqa: F811
    from cb_kernels import cli

    for flag, value, message in (("--max-request-bytes", "0", "must be >= 1"),
                                 ("--max-request-seqs", "-1", "must be >= 1"),
                                 ("--stream-stall-timeout", "0", "must be > 0"),
                                 ("--request-head-timeout", "nan", "must be > 0")):
        with pytest.raises(SystemExit, match=f"{flag} {message}"):
            cli.main(["serve", "--model", str(model_dir), "--port", "0", flag, value])


def test_rl_routes_need_the_key_and_json_too(model_dir, tmp_path):  # noqa: F811
    s = Server(model_dir, tmp_path / "server.log", "--api-key", API_KEY, "--enable-rl-endpoints")
    key = {"Authorization": f"Bearer {API_KEY}"}
    try:
        assert raw(s, "GET", "/is_paused")[0] == 401
        assert raw(s, "POST", "/pause?mode=keep")[0] == 401
        assert raw(s, "POST", "/pause?mode=keep", headers={**key, "Content-Type": ""})[0] == 415
        assert raw(s, "POST", "/pause?mode=keep", headers=key)[0] == 200
        assert raw(s, "GET", "/is_paused", headers=key)[1] == {"is_paused": True}
        assert raw(s, "POST", "/resume", headers=key)[0] == 200
    finally:
        s.stop()
