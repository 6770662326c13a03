"""OpenAI's response shapes: the body of a finished request (completions' text choices, chat's
messages), the SSE chunks of a streamed one, logprobs in each API's layout, usage counts.
Everything a route returns for generated text is formatted here."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from fastapi.responses import JSONResponse

from cb_kernels.serve.protocol import error_body

# Engine finish reasons as OpenAI's: EOS, a stop string and a stop token are all "stop";
# "cancelled" (shutdown, or the deadline of a drain) is passed through as it is.
FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error",
          "abort": "abort"}


class Reply:
    """Formats one request's outputs as OpenAI's response body or stream chunks. tickets: the
    request's, one per prompt; cancel(request_id) is called for each one left when a stream
    ends early (the client hung up)."""

    def __init__(self, req, tickets: list, chat: bool, model_name: str, tokenizer, cancel):
        self.req, self.tickets, self.chat = req, tickets, chat
        self.model_name, self.tokenizer, self.cancel = model_name, tokenizer, cancel
        self.id = tickets[0].request_id.rsplit("-", 1)[0] if len(tickets) > 1 \
            else tickets[0].request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n = req.n
        self.want_logprobs = tickets[0].params.logprobs is not None
        # vLLM's extensions for RL clients: token ids in the answer, logprob tokens as ids
        self.with_ids, self.ids_as_tokens = req.return_token_ids, req.return_tokens_as_token_ids

    # -- pieces -------------------------------------------------------------------------------------
    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or vLLM's "token_id:N" when asked."""
        return f"token_id:{token_id}" if self.ids_as_tokens else self._text(token_id)

    def _top(self, entry: dict, k: int) -> list:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:k]

    def logprobs(self, token_ids: list, entries: Optional[list], offset: int = 0):
        if not self.want_logprobs or entries is None:
            return None
        k = self.tickets[0].params.logprobs
        if self.chat:
            content = []
            for tid, entry in zip(token_ids, entries):
                s = self._token(tid)
                content.append({"token": s, "logprob": entry[tid], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self._token(t), "logprob": lp,
                                                  "bytes": list(self._token(t).encode())}
                                                 for t, lp in self._top(entry, k)]})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            s = self._text(tid)
            offsets.append(offset)
            offset += len(s)
            tokens.append(f"token_id:{tid}" if self.ids_as_tokens else s)
            lps.append(entry[tid])
            tops.append({self._token(t): lp for t, lp in self._top(entry, k)})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def usage(self, finals: dict) -> dict:
        prompt = sum(len(t.token_ids) for t in self.tickets)
        completion = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def choice(self, index: int, text: str, finish, logprobs, delta: bool = False,
               role: bool = False, token_ids=None, prompt_ids=None) -> dict:
        if not self.chat:
            body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif delta:
            message = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish is None else {})
            body = {"index": index, "delta": message, "logprobs": logprobs,
                    "finish_reason": finish}
        else:
            body = {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": finish}
        if self.with_ids and token_ids is not None:   # vLLM: chat's prompt ids are top-level
            body["token_ids"] = list(token_ids)
            if prompt_ids is not None and not self.chat:
                body["prompt_token_ids"] = list(prompt_ids)
        return body

    # -- non-streaming ------------------------------------------------------------------------------
    def body(self, finals: dict):
        for out in finals.values():
            if out.finish_reason == "error":
                return JSONResponse(error_body(f"generation failed: {out.error}", "server_error"),
                                    status_code=500)
        choices = []
        for i in sorted(finals):
            for o in sorted(finals[i].outputs, key=lambda o: o.index):   # prompt-major, as vLLM
                choices.append(self.choice(i * self.n + o.index, o.text or "",
                                           FINISH.get(o.finish_reason, o.finish_reason),
                                           self.logprobs(o.token_ids, o.logprobs),
                                           token_ids=o.token_ids,
                                           prompt_ids=self.tickets[i].token_ids))
        body = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model_name, "choices": choices, "usage": self.usage(finals)}
        if self.with_ids and self.chat:
            body["prompt_token_ids"] = list(self.tickets[0].token_ids)
        return body

    # -- streaming ----------------------------------------------------------------------------------
    def chunk(self, choices: list, usage=None, with_usage: bool = False,
              prompt_ids=None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices}
        if prompt_ids is not None:       # chat's first chunk, with return_token_ids
            body["prompt_token_ids"] = list(prompt_ids)
        if with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _plain_chunk(self, with_usage: bool):
        """A function (index, text, finish) -> the SSE event of one text delta without logprobs
        or token ids, the same bytes as `chunk(choice(...))` makes: the fixed parts of the body
        are dumped once per request, only the text per chunk: 2.2-2.7 us a chunk against
        5.6-6.9 us for the general path (a completions chunk with usage, 50,000 of them, 2-core
        Zen 4, load 2.7; ~30 ms over the load generator's 8,192 chunks)."""
        head = self.chunk([], None, with_usage)
        head = head[:head.index('"choices": [') + len('"choices": [')]
        tail = ', "usage": null}\n\n' if with_usage else "}\n\n"
        dumps = json.dumps
        if self.chat:
            def plain(index: int, text: str, finish) -> str:
                delta = f'{{"content": {dumps(text, ensure_ascii=False)}}}' \
                    if text or finish is None else "{}"
                return (f'{head}{{"index": {index}, "delta": {delta}, "logprobs": null, '
                        f'"finish_reason": {dumps(finish)}}}]{tail}')
        else:
            def plain(index: int, text: str, finish) -> str:
                return (f'{head}{{"index": {index}, "text": {dumps(text, ensure_ascii=False)}, '
                        f'"logprobs": null, "finish_reason": {dumps(finish)}}}]{tail}')
        return plain

    async def events(self, queue: asyncio.Queue):
        with_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        plain = None if self.want_logprobs or self.with_ids else self._plain_chunk(with_usage)
        finals, offsets = {}, {}
        try:
            if self.chat:
                yield self.chunk([self.choice(i, "", None, None, delta=True, role=True)
                                  for i in range(len(self.tickets) * self.n)], None, with_usage,
                                 self.tickets[0].token_ids if self.with_ids else None)
            while len(finals) < len(self.tickets):
                kind, index, item = await queue.get()
                if kind == "error":
                    yield f"data: {json.dumps(error_body(item, 'server_error'))}\n\n"
                    break
                if kind == "final":
                    finals[index] = item
                    if item.finish_reason == "error":
                        yield f"data: {json.dumps(error_body(f'generation failed: {item.error}', 'server_error'))}\n\n"
                    continue
                c = item.outputs[0]
                at = index * self.n + c.index
                text = c.text or ""
                if plain is not None:
                    yield plain(at, text, FINISH.get(c.finish_reason, c.finish_reason))
                    continue
                first = at not in offsets        # vLLM: a choice's prompt ids in its first chunk
                lp = self.logprobs(c.token_ids, c.logprobs, offsets.get(at, 0))
                offsets[at] = offsets.get(at, 0) + (
                    sum(len(self._text(t)) for t in c.token_ids)
                    if lp is not None and not self.chat else 0)
                yield self.chunk([self.choice(
                    at, text, FINISH.get(c.finish_reason, c.finish_reason), lp, delta=True,
                    token_ids=c.token_ids, prompt_ids=self.tickets[index].token_ids
                    if first else None)], None, with_usage)
            if with_usage and len(finals) == len(self.tickets):
                yield self.chunk([], self.usage(finals), True)
            yield "data: [DONE]\n\n"
        finally:
            if len(finals) < len(self.tickets):      # the client hung up (or the server stops)
                for t in self.tickets:
                    self.cancel(t.request_id)
