"""Soak `cb-kernels serve`: N mixed requests from 8 client threads (answers, streams read whole,
streams and non-streamed requests whose client hangs up, bad bodies of every kind the server
refuses), then the server's RSS growth after warm-up and its KV blocks.

    python bench/soak_serve.py --requests 3000 [--json out.json]

The model is the tests' tiny random Llama (2 layers, word tokenizer), so the figure is the
server's own memory, not the model's. Prints one JSON line: requests by kind and status, RSS
(MiB) after the warm-up and at the end, used_blocks at the end.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEMPLATE = ("{% for m in messages %}w1 {{ m['content'].strip() }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")


def tiny_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import VOCAB, make_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def request(port: int, i: int) -> tuple:
    """(kind, status) of request i: the kind cycles through everything a client may do."""
    kinds = ("chat", "stream", "stream_hangup", "wait_hangup", "bad_json", "duplicate_key",
             "text_plain", "too_big", "template_option", "logprobs")
    kind = kinds[i % len(kinds)]
    prompt = [5 + i % 400, 6, 7]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": i}
    ctype = "application/json"
    if kind == "chat":
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"w{3 + i % 400}"}],
                "max_tokens": 16, "n": 2}
    elif kind in ("stream", "stream_hangup"):
        body.update(stream=True, max_tokens=64 if kind == "stream" else 2000, ignore_eos=True)
    elif kind == "wait_hangup":
        body.update(max_tokens=2000, ignore_eos=True)
    elif kind == "logprobs":
        body.update(logprobs=5, n=3)
    elif kind == "template_option":
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
    data = json.dumps(body).encode()
    if kind == "bad_json":
        data = data[:-3]
    elif kind == "duplicate_key":
        data = data[:-1] + b', "max_tokens": 3}'
    elif kind == "text_plain":
        ctype = "text/plain"
    elif kind == "too_big":
        data = json.dumps({**body, "user": "x" * (1 << 20)}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                     data, {"Content-Type": ctype})
        if kind == "wait_hangup":
            time.sleep(0.05)
            conn.sock.shutdown(socket.SHUT_RDWR)
            return kind, "hung up"
        r = conn.getresponse()
        if kind == "stream_hangup":
            r.read1(4096)
            conn.sock.shutdown(socket.SHUT_RDWR)
            return kind, r.status
        r.read()
        return kind, r.status
    except (OSError, http.client.HTTPException) as e:
        return kind, type(e).__name__
    finally:
        conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        tiny_model(model)
        log = open(Path(tmp) / "server.log", "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "cb_kernels", "serve", "--model",
                                 str(model), "--served-model-name", "tiny", "--port", "0",
                                 "--dtype", "float32", "--num-blocks", "1100",
                                 "--max-request-bytes", "262144", "--log-level", "warning"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while True:
                m = re.search(r"on http://127\.0\.0\.1:(\d+) \(ready\)",
                              (Path(tmp) / "server.log").read_text(errors="replace"))
                if m:
                    break
                assert proc.poll() is None and time.monotonic() < deadline, "no start"
                time.sleep(0.1)
            port = int(m.group(1))
            counts: dict = {}
            start = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                warm = list(pool.map(lambda i: request(port, i), range(args.warmup)))
                time.sleep(2)
                rss_warm = rss_mib(proc.pid)
                rest = list(pool.map(lambda i: request(port, i),
                                     range(args.warmup, args.requests)))
            for kind, status in warm + rest:
                key = f"{kind} {status}"
                counts[key] = counts.get(key, 0) + 1
            time.sleep(3)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/health")
            health = json.loads(conn.getresponse().read())
            result = {"requests": args.requests, "seconds": round(time.monotonic() - start, 1),
                      "rss_after_warmup_mib": round(rss_warm, 1),
                      "rss_end_mib": round(rss_mib(proc.pid), 1),
                      "used_blocks_end": health["used_blocks"], "counts": counts}
            result["rss_growth_mib"] = round(result["rss_end_mib"] - rss_warm, 1)
        finally:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
