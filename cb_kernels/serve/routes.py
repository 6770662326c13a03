"""The HTTP routes: a FastAPI app speaking OpenAI's completions and chat completions on an
EngineLoop.

    GET  /health                 200 {"status": "ok", running, waiting, used_blocks, ...};
                                 503 while shutting down or if the engine thread died
    GET  /v1/models              the one model served
    POST /v1/completions         prompt: str, [str], [int] or [[int]]; stream; n; logprobs: k
    POST /v1/chat/completions    messages through the tokenizer's chat template; stream; n;
                                 logprobs + top_logprobs
                                 (both: response_format json_object / json_schema, its grammar
                                 compiled on a worker thread, cached per schema)
    GET  /metrics                Prometheus text (serve/metrics.py)

Per request the routes parse (protocol.py), tokenize (prompts.py), check the request as
Engine.add_request would, hand it to the engine thread and format what comes back
(openai_format.py). Parsing runs on a worker thread, tokenizing, template rendering and the body
of a finished request on one tokenizer thread, so the event loop only moves bytes: /health
answers while a 166 MB logprobs body is built (it used to stall other requests up to 27 s).
guard.py refuses oversized, unauthenticated, non-JSON and misdirected requests before a route
reads them. A refused request gets OpenAI's error body naming the field, with 400 (bad
value), 404 (unknown model) or 503 + Retry-After (queue full, shutting down). Routes are grouped
below by what they serve: server state, models, generation.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cb_kernels.serve import rl_routes
from cb_kernels.serve.engine_loop import Draining, EngineLoop, QueueFull, Ticket
from cb_kernels.serve.guard import Guard
from cb_kernels.serve.metrics import ServerMetrics
from cb_kernels.serve.openai_format import Reply
from cb_kernels.serve.prompts import Prompts
from cb_kernels.serve.protocol import (ChatRequest, CompletionRequest, RequestError,
                                       check_duplicate_keys, check_unsupported,
                                       error_body, prompt_error, requested_max_tokens,
                                       sampling_params, structured_field, structured_output,
                                       validation_error)

RETRY_AFTER_S = 1


class ServerConfig:
    """What the routes need of the command line; the defaults are `cb-kernels serve`'s."""

    def __init__(self, model_name: str, max_waiting: int = 256, drain_timeout: float = 30.0,
                 enable_rl_endpoints: bool = False, max_request_seqs: int = 256,
                 max_request_tokens: int = 1 << 20, max_request_bytes: int = 8 << 20,
                 api_key=None, allowed_hosts=None, protect_metrics: bool = False,
                 stream_buffer: int = 256, stream_stall_timeout: float = 30.0,
                 max_header_bytes: int = 16384):
        self.model_name, self.max_waiting = model_name, max_waiting
        self.drain_timeout = drain_timeout
        self.enable_rl_endpoints = enable_rl_endpoints      # serve/rl_routes.py
        self.max_request_seqs, self.max_request_tokens = max_request_seqs, max_request_tokens
        self.max_request_bytes, self.api_key = max_request_bytes, api_key
        self.allowed_hosts, self.protect_metrics = allowed_hosts, protect_metrics
        self.stream_buffer, self.stream_stall_timeout = stream_buffer, stream_stall_timeout
        self.max_header_bytes = max_header_bytes


class ClientGone(Exception):
    pass


def create_app(engine, config: ServerConfig, on_ready=None):
    """The ASGI app of `engine` (the FastAPI app behind guard.Guard; its engine thread starts
    with the app's lifespan). `on_ready()` runs once the engine thread is up."""
    metrics = ServerMetrics(config.model_name)
    loop = EngineLoop(engine, config.max_waiting, metrics, stream_buffer=config.stream_buffer)
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
            state.pool.shutdown(wait=False, cancel_futures=True)

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

    # -- server state: health, metrics
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

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    # -- models
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != config.model_name:
            raise state.unknown_model(name)
        return state.model_card()

    # -- generation
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.handle(request, ChatRequest)

    if config.enable_rl_endpoints:       # behind the Guard too: the API key covers them
        rl_routes.register(app, loop)
    return Guard(app, config.max_request_bytes, config.api_key, config.allowed_hosts,
                 config.protect_metrics, config.stream_stall_timeout, config.max_header_bytes,
                 rl_routes.BODILESS if config.enable_rl_endpoints else frozenset())


class _State:
    def __init__(self, engine, loop: EngineLoop, metrics: ServerMetrics, config: ServerConfig):
        self.engine, self.loop, self.metrics, self.config = engine, loop, metrics, config
        self.prompts = Prompts(engine.tokenizer, engine.max_positions)
        # One thread: the tokenizer copy is not safe to use from two threads at once. Streams
        # decode their logprob tokens on the event loop, with a copy of their own.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="cb-kernels-tokenizer")
        self.stream_tokenizer = copy.deepcopy(self.prompts.tokenizer)
        self.max_positions = engine.max_positions
        self.pool_tokens = engine.num_pool_tokens
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
        aio_loop = asyncio.get_running_loop()
        req = await asyncio.to_thread(self.parse, await request.body(), schema)
        if req.model != self.config.model_name:
            raise self.unknown_model(req.model)
        check_unsupported(req)
        chat = schema is ChatRequest
        count = len(req.prompt) if not chat and isinstance(req.prompt, list) and req.prompt \
            and not isinstance(req.prompt[0], int) else 1
        self.check_fan_out(req, count)
        structured = structured_output(req)
        if structured is not None:     # a compile can take long: never on the event loop
            await asyncio.to_thread(self.compile, structured, structured_field(req))
        prompts = await aio_loop.run_in_executor(self.pool, self.prompts.of, req)
        tickets = self.tickets(req, prompts, chat, structured)
        queue = asyncio.Queue()
        for t in tickets:
            t.aio_loop, t.queue = aio_loop, queue
        try:
            self.loop.submit(tickets)
        except QueueFull:
            self.metrics.reject()
            raise RequestError(f"the server is at capacity ({self.config.max_waiting} sequences "
                               "waiting); retry later", None, 503, "server_overloaded",
                               "queue_full", {"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining:
            self.metrics.reject()
            if self.loop.error is not None:
                raise RequestError(f"the engine failed ({self.loop.error}); restart the server",
                                   None, 503, "server_error", "engine_failed") from None
            raise RequestError("the server is shutting down", None, 503, "server_unavailable",
                               "shutting_down", {"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = Reply(req, tickets, chat, self.config.model_name,
                      self.stream_tokenizer if req.stream else self.prompts.tokenizer,
                      self.loop.cancel)
        if req.stream:
            return _Stream(reply.events(queue), media_type="text/event-stream",
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
        return await aio_loop.run_in_executor(self.pool, _render, reply, finals)

    def check_fan_out(self, req, count: int) -> None:
        """RequestError naming the cap a request of `count` prompts x n samples passes: the
        sequences it adds (256 prompts x n=128 in one 5 KB body became 32,768 sequences and
        +8 GB), and the tokens they may generate."""
        seqs = count * req.n
        cap = min(self.config.max_request_seqs, self.config.max_waiting)
        if seqs > cap:
            flag = "--max-request-seqs" if cap == self.config.max_request_seqs else "--max-waiting"
            raise RequestError(f"this request asks for {count} prompts x n={req.n} = {seqs} "
                               f"sequences, more than this server takes in one request ({cap}, "
                               f"{flag})", "n" if count == 1 else "prompt",
                               code="too_many_sequences")
        asked = requested_max_tokens(req)
        if asked is not None and seqs * asked > self.config.max_request_tokens:
            raise RequestError(f"this request may generate {seqs} sequences x max_tokens={asked} "
                               f"= {seqs * asked} tokens, more than this server allows in one "
                               f"request ({self.config.max_request_tokens}, "
                               "--max-request-tokens)", "max_tokens", code="too_many_tokens")

    def parse(self, raw: bytes, schema):
        """The request `raw` as `schema` (run on a worker thread)."""
        check_duplicate_keys(raw)
        try:
            return schema.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e) from None

    def compile(self, structured, field: str) -> None:
        """Compile `structured`'s grammar (asked for by the request field `field`) into the
        engine's cache (run on a worker thread)."""
        try:
            self.engine.compile_grammar(structured)
        except ValueError as e:
            raise RequestError(str(e), field, code="invalid_response_format") from None
        except ImportError as e:
            raise RequestError(f"this server cannot do structured output ({e})",
                               field, code="unsupported_response_format") from None

    def tickets(self, req, prompts: list, chat: bool, structured=None) -> list:
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        what = "messages" if chat else "prompt"
        tickets = []
        for i, ids in enumerate(prompts):
            max_new = requested_max_tokens(req)
            if max_new is None:      # chat: the rest of the context; completions: OpenAI's 16
                max_new = max(1, min(self.max_positions, self.pool_tokens) - len(ids) + 1) \
                    if chat else 16
                # within --max-request-tokens for the request's sequences
                max_new = max(1, min(max_new, self.config.max_request_tokens
                                     // (len(prompts) * req.n)))
            params = sampling_params(req, max_new, structured)
            where = what if len(prompts) == 1 or chat else f"prompt[{i}]"
            try:
                ids, params = self.engine.check_request(ids, params)
            except (ValueError, TypeError) as e:
                raise RequestError(*prompt_error(str(e), where, requested_max_tokens(req)
                                                  is not None)) from None
            tickets.append(Ticket(f"{base}-{i}" if len(prompts) > 1 else base, ids, params,
                                  req.stream, index=i))
        return tickets


class _Stream(StreamingResponse):
    """A stream whose generator is closed however the response ends: when guard.Guard gives up
    on a client that reads nothing, the generator waits at a `yield` and only its close runs
    Reply.events' cleanup, which cancels the requests (their KV blocks come back)."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _render(reply: Reply, finals: dict) -> Response:
    """The response of a finished request, its JSON bytes made here (on the tokenizer thread)."""
    body = reply.body(finals)
    if isinstance(body, Response):
        return body
    return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json")


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


