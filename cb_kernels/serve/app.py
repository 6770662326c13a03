"""The HTTP side: a FastAPI app speaking OpenAI's completions and chat completions on an EngineLoop.

    GET  /health                 200 {"status": "ok", running, waiting, used_blocks, ...};
                                 503 while shutting down or if the engine thread died
    GET  /v1/models              the one model served
    POST /v1/completions         prompt: str, [str], [int] or [[int]]; stream; n; logprobs: k
    POST /v1/chat/completions    messages through the tokenizer's chat template; stream; n;
                                 logprobs + top_logprobs
    GET  /metrics                Prometheus text (serve/metrics.py)

Everything the event loop does is parse, tokenize (with its own copy of the tokenizer: the engine
thread decodes with the other), check the request as Engine.add_request would, hand it to the
engine thread and format what comes back. A refused request gets OpenAI's error body naming the
field, with 400 (bad value), 404 (unknown model) or 503 + Retry-After (queue full, shutting down).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cb_kernels.serve.engine_loop import Draining, EngineLoop, QueueFull, Ticket
from cb_kernels.serve.metrics import ServerMetrics
from cb_kernels.serve.protocol import (ChatRequest, CompletionRequest, RequestError, check_unsupported,
                                       error_body, field_path, param_named_in, requested_max_tokens,
                                       sampling_params)

# Engine finish reasons as OpenAI's: EOS, a stop string and a stop token are all "stop";
# "cancelled" (shutdown, or the deadline of a drain) is passed through as it is.
_FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled", "error": "error"}
RETRY_AFTER_S = 1
# Names pydantic puts in an error location for the member of a union that failed.
_UNION_TYPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids", "stop": "a string or a list of strings"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


class ServerConfig:
    def __init__(self, model_name: str, max_waiting: int = 256, drain_timeout: float = 30.0):
        self.model_name, self.max_waiting, self.drain_timeout = model_name, max_waiting, drain_timeout


class ClientGone(Exception):
    pass


def create_app(engine, config: ServerConfig, on_ready=None) -> FastAPI:
    """The app of `engine` (its thread starts with the app's lifespan). `on_ready()` runs once the
    engine thread is up."""
    metrics = ServerMetrics(config.model_name)
    loop = EngineLoop(engine, config.max_waiting, metrics)
    state = _State(engine, loop, metrics, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    app = FastAPI(title="cb_kernels", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serve = state

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}",
                                       code="not_found"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request, e):
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"),
                            status_code=405)

    @app.get("/health")
    async def health():
        body = {"status": "ok", "model": config.model_name, **state.counts()}
        if loop.error is not None:
            body.update(status="failed", error=loop.error)
            return JSONResponse(body, status_code=503)
        if loop.draining:
            body["status"] = "draining"
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != config.model_name:
            raise state.unknown_model(name)
        return state.model_card()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.handle(request, ChatRequest)

    return app


class _State:
    def __init__(self, engine, loop: EngineLoop, metrics: ServerMetrics, config: ServerConfig):
        self.engine, self.loop, self.metrics, self.config = engine, loop, metrics, config
        # The engine thread decodes with engine.tokenizer; the event loop encodes with its own copy
        # (a fast tokenizer is not safe to use from two threads at once).
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.max_positions = engine.runner.max_positions
        bm = engine.block_manager
        self.pool_tokens = bm.num_blocks * bm.block_size
        self.created = int(time.time())

    def counts(self) -> dict:
        s = self.loop.snapshot
        return {"running": s["running"], "waiting": s["waiting"], "swapped": s["swapped"],
                "used_blocks": s["used_blocks"], "num_blocks": s["num_blocks"],
                "queued": self.loop.num_queued}

    def model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created,
                "owned_by": "cb_kernels", "max_model_len": self.max_positions}

    def unknown_model(self, name) -> RequestError:
        return RequestError(f"model {name!r} is not served here; this server serves "
                            f"{self.config.model_name!r}", "model", 404, code="model_not_found")

    # -- one request -----------------------------------------------------------------------------
    async def handle(self, request: Request, schema):
        req = self.parse(await request.body(), schema)
        if req.model != self.config.model_name:
            raise self.unknown_model(req.model)
        check_unsupported(req)
        chat = schema is ChatRequest
        prompts = self.chat_prompt(req) if chat else self.completion_prompts(req)
        if len(prompts) > self.config.max_waiting:     # a 503 would never clear
            raise RequestError(f"prompt holds {len(prompts)} prompts, more than this server "
                               f"queues at once ({self.config.max_waiting}, --max-waiting)",
                               "prompt")
        tickets = self.tickets(req, prompts, chat)
        aio_loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        for t in tickets:
            t.aio_loop, t.queue = aio_loop, queue
        try:
            self.loop.submit(tickets)
        except QueueFull:
            self.metrics.reject()
            raise RequestError(f"the server is at capacity ({self.config.max_waiting} requests "
                               "waiting); retry later", None, 503, "server_overloaded",
                               "queue_full", {"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining:
            self.metrics.reject()
            if self.loop.error is not None:
                raise RequestError(f"the engine failed ({self.loop.error}); restart the server",
                                   None, 503, "server_error", "engine_failed") from None
            raise RequestError("the server is shutting down", None, 503, "server_unavailable",
                               "shutting_down", {"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = _Reply(self, req, tickets, chat)
        if req.stream:
            return StreamingResponse(reply.events(queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            finals = await _collect(request, queue, len(tickets))
        except ClientGone:
            for t in tickets:
                self.loop.cancel(t.request_id)
            return Response(status_code=499)
        except asyncio.CancelledError:
            for t in tickets:
                self.loop.cancel(t.request_id)
            raise
        return reply.body(finals)

    def parse(self, raw: bytes, schema):
        try:
            return schema.model_validate_json(raw)
        except ValidationError as e:
            raise _validation_error(e) from None

    def encode(self, text: str, param: str) -> list:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send prompt token ids instead of "
                               "text", param)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def completion_prompts(self, req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str):
            return [self.encode(p, "prompt")]
        if not p:
            raise RequestError("prompt is an empty list", "prompt")
        if isinstance(p[0], str):
            return [self.encode(s, f"prompt[{i}]") for i, s in enumerate(p)]
        if isinstance(p[0], int):
            return [list(p)]
        for i, ids in enumerate(p):
            if not ids:
                raise RequestError(f"prompt[{i}] is an empty list of token ids", f"prompt[{i}]")
        return [list(ids) for ids in p]

    def chat_prompt(self, req: ChatRequest) -> list:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions",
                               "messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise RequestError(f"messages[{i}].content[{j}]: only text parts are "
                                           f"supported, got type {part.type!r}",
                                           f"messages[{i}].content[{j}].type")
                content = "".join(part.text for part in content)
            msg = {**(m.model_extra or {}), "role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                          tokenize=True, return_dict=False,
                                          **(req.chat_template_kwargs or {}))
        except Exception as e:       # jinja2's TemplateError, UndefinedError, ... of the template
            raise RequestError(f"the chat template cannot render messages ({type(e).__name__}: "
                               f"{e})", "messages") from None
        return [list(ids)]

    def tickets(self, req, prompts: list, chat: bool) -> list:
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        what = "messages" if chat else "prompt"
        tickets = []
        for i, ids in enumerate(prompts):
            max_new = requested_max_tokens(req)
            if max_new is None:      # chat: the rest of the context; completions: OpenAI's 16
                max_new = max(1, min(self.max_positions, self.pool_tokens) - len(ids) + 1) \
                    if chat else 16
            params = sampling_params(req, max_new)
            where = what if len(prompts) == 1 or chat else f"prompt[{i}]"
            try:
                ids, params = self.engine.check_request(ids, params)
            except (ValueError, TypeError) as e:
                raise RequestError(*_prompt_error(str(e), where, requested_max_tokens(req)
                                                  is not None)) from None
            tickets.append(Ticket(f"{base}-{i}" if len(prompts) > 1 else base, ids, params,
                                  req.stream, index=i))
        return tickets


def _prompt_error(message: str, where: str, asked_max_tokens: bool) -> tuple:
    """(message, param) of an Engine.check_request error about the prompt at `where`."""
    about_length = "max_new_tokens" in message
    message = message.replace("max_new_tokens", "max_tokens")
    if message.startswith("prompt"):
        message = where + message[len("prompt"):]
    if about_length:          # the prompt fits alone: max_tokens is what to change, if it was asked
        return message, "max_tokens" if asked_max_tokens else where
    if message.startswith(where):
        return message, where
    return message, param_named_in(message, where)


def _validation_error(e: ValidationError) -> RequestError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})")
    loc = [p for p in first["loc"] if isinstance(p, int) or
           (p not in _UNION_TAGS and "[" not in str(p) and not str(p).startswith("function-"))]
    param = field_path(loc) or None
    if param is None:
        return RequestError(f"the request body must be a JSON object ({first['msg']})")
    same = [err for err in errors if err["loc"][:1] == first["loc"][:1]]
    if first["type"] == "missing":
        return RequestError(f"{param} is required", param)
    if first["type"] == "extra_forbidden":
        return RequestError(f"{param} is not a field this server knows (check the spelling)",
                            param)
    if len(same) > 1 and len(loc) == 1:      # no member of a union took it
        what = _UNION_TYPES.get(param, "of another type")
        return RequestError(f"{param} must be {what}, got {_short(first['input'])}", param)
    return RequestError(f"{param}: {first['msg']}, got {_short(first['input'])}", param)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, queue: asyncio.Queue, count: int) -> dict:
    """{prompt index: final RequestOutput} of `count` tickets; ClientGone if the client hangs up
    first; RequestError(500) if the engine failed."""
    finals = {}
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while len(finals) < count:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                raise ClientGone()
            kind, index, item = get.result()
            if kind == "error":
                raise RequestError(item, None, 500, "server_error")
            if kind == "final":
                finals[index] = item
    finally:
        gone.cancel()
    return finals


class _Reply:
    """Formats one request's outputs as OpenAI's response body or stream chunks."""

    def __init__(self, state: _State, req, tickets: list, chat: bool):
        self.state, self.req, self.tickets, self.chat = state, req, tickets, chat
        self.id = tickets[0].request_id.rsplit("-", 1)[0] if len(tickets) > 1 \
            else tickets[0].request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n = req.n
        self.tokenizer = state.tokenizer
        self.want_logprobs = tickets[0].params.logprobs is not None

    # -- pieces -------------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

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
            s = self._token(tid)
            offsets.append(offset)
            offset += len(s)
            tokens.append(s)
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
               role: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish is None else {})
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}

    # -- non-streaming ------------------------------------------------------------------------------
    def body(self, finals: dict):
        for out in finals.values():
            if out.finish_reason == "error":
                return JSONResponse(error_body(f"generation failed: {out.error}", "server_error"),
                                    status_code=500)
        choices = []
        for i in sorted(finals):
            for o in finals[i].outputs:
                choices.append(self.choice(i * self.n + o.index, o.text or "",
                                           _FINISH.get(o.finish_reason, o.finish_reason),
                                           self.logprobs(o.token_ids, o.logprobs)))
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.state.config.model_name, "choices": choices,
                "usage": self.usage(finals)}

    # -- streaming ----------------------------------------------------------------------------------
    def chunk(self, choices: list, usage=None, with_usage: bool = False) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.state.config.model_name, "choices": choices}
        if with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, queue: asyncio.Queue):
        with_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        finals, offsets = {}, {}
        try:
            if self.chat:
                yield self.chunk([self.choice(i, "", None, None, delta=True, role=True)
                                  for i in range(len(self.tickets) * self.n)], None, with_usage)
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
                lp = self.logprobs(c.token_ids, c.logprobs, offsets.get(at, 0))
                if lp is not None and not self.chat:
                    offsets[at] = offsets.get(at, 0) + sum(len(s) for s in lp["tokens"])
                yield self.chunk([self.choice(at, text, _FINISH.get(c.finish_reason,
                                                                    c.finish_reason), lp,
                                              delta=True)], None, with_usage)
            if with_usage and len(finals) == len(self.tickets):
                yield self.chunk([], self.usage(finals), True)
            yield "data: [DONE]\n\n"
        finally:
            if len(finals) < len(self.tickets):      # the client hung up (or the server stops)
                for t in self.tickets:
                    self.state.loop.cancel(t.request_id)
