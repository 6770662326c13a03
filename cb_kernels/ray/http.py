"""ServeClient: Ray Data rows through several running `cb-kernels serve` replicas over HTTP.

For when the engines already serve (one `cb-kernels serve` per machine or per GPU) and a batch job
should share them: `dataset.map_batches(ServeClient, fn_constructor_kwargs={"urls": [...],
"model": NAME}, compute=ray.data.ActorPoolStrategy(size=K), batch_size=B)`. Each actor sends the
rows of a batch concurrently (`max_in_flight` at once, so every server's continuous batching sees
many requests), spreads them over the replicas, and moves a row to the next replica when one does
not answer (connection refused, reset, timed out, or 503 while it drains or its queue is full).
Standard library only (urllib): Ray Data's own HTTP processor (ray.data.llm) needs aiohttp.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from cb_kernels.ray.replica import PROMPT_KEYS, _record_of, rows_of, table_of

# A jsonl line's SamplingParams fields -> the OpenAI request body's names (serve's protocol.py).
_BODY_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature":
                "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                "stop": "stop", "ignore_eos": "ignore_eos", "repetition_penalty":
                "repetition_penalty", "presence_penalty": "presence_penalty", "frequency_penalty":
                "frequency_penalty", "stop_token_ids": "stop_token_ids"}
COLUMNS = ("text", "finish_reason", "error", "num_prompt_tokens", "num_tokens", "replica")


class ServeClient:
    """urls: base URLs of `cb-kernels serve` replicas ("http://host:port"); model: the served
    model name; defaults: request body fields for every row (OpenAI names, e.g. {"max_tokens":
    64, "temperature": 0}); a row's own sampling fields (jsonl names) override them."""

    def __init__(self, urls, *, model: str, defaults=None, max_in_flight: int = 16,
                 timeout_s: float = 600.0, api_key=None):
        if isinstance(urls, str) or not urls or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"urls must be a non-empty list of base URLs, got {urls!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.urls = [u.rstrip("/") for u in urls]
        self.model, self.defaults = model, dict(defaults or {})
        self.max_in_flight, self.timeout_s = max_in_flight, timeout_s
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.offset = os.getpid()          # actors start their rows on different replicas

    def __call__(self, batch):
        import pyarrow as pa

        rows = [_record_of(row) for row in rows_of(batch)]
        with ThreadPoolExecutor(self.max_in_flight) as pool:
            results = list(pool.map(self._one, range(len(rows)), rows))
        self.offset += len(rows)
        types = {c: pa.int64() if c.startswith("num_") else pa.string() for c in COLUMNS}
        return table_of(batch, {c: [res.get(c) for res in results] for c in COLUMNS}, types)

    def _body(self, rec: dict) -> tuple:
        keys = [k for k in PROMPT_KEYS if k in rec]
        if len(keys) != 1:
            raise ValueError("expected exactly one of " + ", ".join(map(repr, PROMPT_KEYS)))
        body = {"model": self.model, **self.defaults,
                **{_BODY_FIELDS[k]: v for k, v in rec.items() if k in _BODY_FIELDS}}
        if keys[0] == "messages":
            return "/v1/chat/completions", {**body, "messages": rec["messages"]}
        return "/v1/completions", {**body, "prompt": rec[keys[0]]}

    def _one(self, i: int, rec: dict) -> dict:
        try:
            path, body = self._body(rec)
        except ValueError as e:
            return {"finish_reason": "error", "error": str(e)}
        data, failures = json.dumps(body).encode(), []
        for k in range(len(self.urls)):
            url = self.urls[(self.offset + i + k) % len(self.urls)]
            req = urllib.request.Request(url + path, data=data, headers=self.headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as e:
                if e.code == 503:            # draining or its queue is full: another replica
                    failures.append(f"{url}: 503")
                    continue
                try:
                    message = json.loads(e.read())["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = e.reason
                return {"finish_reason": "error", "error": f"{url}: {e.code} {message}",
                        "replica": url}
            except OSError as e:             # refused, reset, timed out: the replica is gone
                failures.append(f"{url}: {e}")
                continue
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return {"text": text, "finish_reason": choice["finish_reason"], "replica": url,
                    "num_prompt_tokens": usage.get("prompt_tokens"),
                    "num_tokens": usage.get("completion_tokens")}
        return {"finish_reason": "error", "error": "no replica answered: " + "; ".join(failures)}
