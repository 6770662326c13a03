"""`cb-kernels serve` as a real process on 127.0.0.1, driven by the openai client: answers equal
transformers' greedy tokens, streams equal non-streamed answers, n/logprobs/stop, sampling
fields, 24 concurrent clients; the engine's used_blocks back to 0 after each. The server, its
model and the helpers here are shared: test_serve_http_errors.py (bad input, clients hanging up,
a full queue and SIGTERM), test_serve_hardening.py and test_serve_structured.py import them.

Needs the `serve` extra (fastapi, uvicorn, prometheus_client) and the openai client (`test`
extra); CI installs both (README's test command), so there these tests always run.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

if os.environ.get("CBK_REQUIRE_SERVE_TESTS"):     # .ci/run sets it: a missing extra fails there
    import fastapi, openai, prometheus_client, uvicorn  # noqa: E401, F401
else:                                   # a user without the extra gets told why these skip
    for _name in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(_name, reason="needs the serve extra: pip install -e '.[serve]'")
    openai = pytest.importorskip("openai", reason="needs the openai client (the test extra)")

from tests.helpers import VOCAB, make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
MAX_POSITIONS = 8192
LONG_RUN = 8000          # tokens of a request that outlives a 3 s drain (~0.7 ms a token alone)
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'].strip() }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Llama with a word tokenizer ("w1".."w499" are token ids 1..499) whose chat
    template renders each message as "w1 <content>" and the generation prompt as "w2"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0)
    path = tmp_path_factory.mktemp("serve_model")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


class Server:
    def __init__(self, model_dir, log: Path, *extra):
        self.log = log
        cmd = [sys.executable, "-m", "cb_kernels", "serve", "--model", str(model_dir),
               "--served-model-name", NAME, "--port", "0", "--dtype", "float32",
               "--block-size", "16", "--num-blocks", "1100", "--cpu-offload-gib", "0",
               "--log-level", "info", *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(log, "wb"))
        deadline = time.monotonic() + 90
        while True:
            m = re.search(r"on http://127\.0\.0\.1:(\d+) \(ready\)", self.output())
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not start:\n{self.output()}")
            time.sleep(0.1)
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str):
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/health")[1])

    def post(self, path: str, body) -> tuple:
        """(status, json body, headers) of a raw POST; `body` bytes are sent as they are."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """/health once nothing runs, waits or holds a block (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["used_blocks"] == 0 and h["running"] == 0 and h["waiting"] == 0 \
                    and h["queued"] == 0:
                return h
            assert time.monotonic() < deadline, f"the engine is not idle: {h}"
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("serve_log") / "server.log",
               "--max-num-seqs", "32", "--max-batch-tokens", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens of transformers' generate for a token-id prompt."""
    from cb_kernels.models import load

    model, _ = load(model_dir, dtype="float32")

    @torch.inference_mode()
    def greedy(prompt: list, n: int) -> list:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        return ids[0, len(prompt):].tolist()
    return greedy


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def ids_of(text: str) -> list:
    return [int(w[1:]) for w in text.split()]


def prompts(count: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 40, (count,), generator=g)]


def _cancelled_count(server) -> float:
    text = server.get("/metrics")[1]
    m = re.search(r'cb_kernels_requests_total\{finish_reason="cancelled",model_name="tiny"\} (\S+)',
                  text)
    return float(m.group(1)) if m else 0.0


def _raw_request(server, path, body) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


# -- answers --------------------------------------------------------------------------------------
def test_models_health_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.get("/v1/models/" + NAME)[0] == 200
    status, body = server.get("/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    h = server.health()
    assert h["status"] == "ok" and h["model"] == NAME and h["num_blocks"] == 1100
    server.client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    status, text = server.get("/metrics")
    assert status == 200
    for name in ("cb_kernels_requests_running", "cb_kernels_requests_waiting",
                 "cb_kernels_kv_blocks_used", "cb_kernels_kv_blocks_total",
                 "cb_kernels_prompt_tokens_total", "cb_kernels_generation_tokens_total",
                 "cb_kernels_time_to_first_token_seconds_bucket",
                 "cb_kernels_inter_token_latency_seconds_bucket"):
        assert f"\n{name}" in text, name
    count = re.search(r'cb_kernels_time_to_first_token_seconds_count\{model_name="tiny"\} (\S+)', text)
    assert float(count.group(1)) >= 1
    itl = re.search(r'cb_kernels_inter_token_latency_seconds_count\{model_name="tiny"\} (\S+)', text)
    assert float(itl.group(1)) >= 3     # 4 tokens: 3 gaps
    assert 'cb_kernels_kv_blocks_total{model_name="tiny"} 1100.0' in text


def test_completion_and_chat_equal_transformers_greedy(server, reference):
    prompt = [11, 22, 33, 44, 55]
    want = reference(prompt, 8)
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert ids_of(r.choices[0].text) == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 8)
    r = server.client.completions.create(model=NAME, prompt=words(prompt), max_tokens=8,
                                         temperature=0)
    assert ids_of(r.choices[0].text) == want
    # The chat template renders [user "w40 w41"] as "w1 w40 w41 w2".
    c = server.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": " w40 w41 "}], max_tokens=6,
        temperature=0)
    assert c.choices[0].message.role == "assistant"
    assert ids_of(c.choices[0].message.content) == reference([1, 40, 41, 2], 6)
    assert c.usage.prompt_tokens == 4 and c.choices[0].finish_reason == "length"
    # Text parts are joined; several prompts in one completions request come back in order.
    c2 = server.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": [{"type": "text", "text": "w40"},
                                                           {"type": "text", "text": " w41"}]}],
        max_tokens=6, temperature=0)
    assert c2.choices[0].message.content == c.choices[0].message.content
    r = server.client.completions.create(model=NAME, prompt=[[5, 6], [7, 8, 9]], max_tokens=3,
                                         temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ids_of(ch.text) for ch in r.choices] == [reference([5, 6], 3)] * 2 + \
        [reference([7, 8, 9], 3)] * 2
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    server.wait_idle()


def _stream_texts(chunks, chat: bool) -> tuple:
    texts, finish, usage, logprobs = {}, {}, None, {}
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
            if c.logprobs is not None:
                entries = c.logprobs.content if chat else c.logprobs.token_logprobs
                logprobs.setdefault(c.index, []).extend(
                    [e.logprob for e in entries] if chat else entries)
    return texts, finish, usage, logprobs


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_equals_non_streaming(server, chat):
    kw = dict(model=NAME, max_tokens=12, temperature=0.9, seed=7, n=3)
    if chat:
        kw.update(messages=[{"role": "system", "content": "w9"}, {"role": "user", "content": "w8"}],
                  logprobs=True, top_logprobs=2)
        create = server.client.chat.completions.create
    else:
        kw.update(prompt="w3 w4 w5", logprobs=2)
        create = server.client.completions.create
    full = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finish, usage, logprobs = _stream_texts(chunks, chat)
    assert len(full.choices) == 3
    for c in full.choices:
        assert texts[c.index] == (c.message.content if chat else c.text)
        assert finish[c.index] == c.finish_reason == "length"
        want = [e.logprob for e in c.logprobs.content] if chat else c.logprobs.token_logprobs
        assert logprobs[c.index] == pytest.approx(want)
    assert usage.model_dump() == full.usage.model_dump()
    assert chunks[-1].choices == [] and all(ch.usage is None for ch in chunks[:-1])
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
    # Without include_usage no chunk carries usage.
    plain = list(create(**kw, stream=True))
    assert all(getattr(ch, "usage", None) is None for ch in plain)
    assert _stream_texts(plain, chat)[0] == texts
    server.wait_idle()


def test_n_samples_with_logprobs(server):
    r = server.client.completions.create(model=NAME, prompt=[7, 8, 9], max_tokens=10, n=4,
                                         temperature=1.0, seed=3, logprobs=3)
    assert len(r.choices) == 4 and r.usage.completion_tokens == 40
    assert len({c.text for c in r.choices}) > 1          # 4 samples of a random model differ
    for c in r.choices:
        lp = c.logprobs
        assert lp.tokens == c.text.split() and len(lp.token_logprobs) == 10
        for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert len(top) == 3 and chosen <= 0
            assert list(top.values()) == sorted(top.values(), reverse=True)
            if token in top:
                assert top[token] == pytest.approx(chosen)
            else:
                assert chosen <= min(top.values())
        assert lp.text_offset[0] == 0
    again = server.client.completions.create(model=NAME, prompt=[7, 8, 9], max_tokens=10, n=4,
                                             temperature=1.0, seed=3, logprobs=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]   # seeded
    # Greedy logprobs: the chosen token is the top one.
    c = server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w5"}],
                                              max_tokens=5, temperature=0, logprobs=True,
                                              top_logprobs=4)
    for e in c.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode() == e.token
    server.wait_idle()


def test_stop_strings_and_tokens(server, reference):
    prompt = [100, 101, 102]
    want = reference(prompt, 12)
    # The first token (past the second) whose word does not occur in the text before it.
    cut = next(i for i in range(2, 12) if f"w{want[i]}" not in words(want[:i]))
    stop = f"w{want[cut]}"
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                         stop=[stop, "never-there"])
    assert r.choices[0].text.strip() == words(want[:cut]) and r.choices[0].finish_reason == "stop"
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                   temperature=0, stop=stop, stream=True))
    assert _stream_texts(chunks, False)[0][0] == r.choices[0].text
    assert _stream_texts(chunks, False)[1][0] == "stop"
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                         stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text.split() == words(want[:cut + 1]).split()
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"stop_token_ids": [want[cut]]})
    assert ids_of(r.choices[0].text) == want[:cut + 1] and r.choices[0].finish_reason == "stop"
    server.wait_idle()


def test_sampling_fields_reach_the_engine(server, reference):
    prompt = [60, 61, 62]
    want = reference(prompt, 4)
    # A bias of +100 on one token makes greedy pick it every time.
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                         logit_bias={"77": 100})
    assert ids_of(r.choices[0].text) == [77] * 4
    # top_k=1 is greedy whatever the temperature; min_tokens/ignore_eos are accepted.
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=1.5,
                                         extra_body={"top_k": 1, "min_tokens": 2,
                                                     "ignore_eos": True, "min_p": 0.1})
    assert ids_of(r.choices[0].text) == want
    # A presence penalty changes a greedy answer that repeats tokens.
    base = server.client.completions.create(model=NAME, prompt=[5, 5, 5], max_tokens=24,
                                            temperature=0)
    pen = server.client.completions.create(model=NAME, prompt=[5, 5, 5], max_tokens=24,
                                           temperature=0, presence_penalty=2.0)
    repeats = len(set(base.choices[0].text.split()))
    assert repeats < 24                     # the random model repeats itself...
    assert len(set(pen.choices[0].text.split())) > repeats     # ...less with the penalty
    server.wait_idle()


def test_24_concurrent_clients_equal_sequential(server):
    ps = prompts(24, seed=1)
    sequential = [server.client.completions.create(model=NAME, prompt=p, max_tokens=10,
                                                   temperature=0).choices[0].text for p in ps]

    def one(i):
        p = ps[i]
        if i % 3 == 0:
            stream = server.client.completions.create(model=NAME, prompt=p, max_tokens=10,
                                                      temperature=0, stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)
        if i % 3 == 1:
            c = server.client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                            "content": words(p)}],
                                                      max_tokens=10, temperature=0)
            return c.choices[0].message.content
        return sampled(i) if i % 6 == 5 else server.client.completions.create(
            model=NAME, prompt=p, max_tokens=10, temperature=0).choices[0].text

    def sampled(i):     # its own temperature, top_p and seed: the batch must not change them
        return server.client.completions.create(model=NAME, prompt=ps[i], max_tokens=10,
                                                temperature=0.8, top_p=0.9,
                                                seed=i).choices[0].text

    chat_want = {i: server.client.completions.create(
        model=NAME, prompt=[1, *ps[i], 2], max_tokens=10, temperature=0).choices[0].text
        for i in range(1, 24, 3)}
    sampled_want = {i: sampled(i) for i in range(5, 24, 6)}
    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(one, range(24)))
    for i in range(24):
        assert got[i] == sampled_want.get(i, chat_want.get(i, sequential[i])), i
    assert sampled_want[5] != sequential[5]
    server.wait_idle()

