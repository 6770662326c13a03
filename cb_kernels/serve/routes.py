"""The HTTP routes: a FastAPI app speaking OpenAI's completions and chat completions on an
EngineLoop.

    GET  /health                 200 {"status": "ok", running, waiting, used_blocks, ...};
                                 503 while shutting down or if the engine thread died
    GET  /v1/models              the one model served
    POST /v1/completions         prompt: str, [str], [int] or [[int]]; stream; n; logprobs: k
    POST /v1/chat/completions    messages through the tokenizer's chat template; stream; n;
                                 logprobs + top_logprobs
    GET  /metrics                Prometheus text (serve/metrics.py)

Everything the event loop does is parse (protocol.py), tokenize (prompts.py), check the request as
Engine.add_request would, hand it to the engine thread and format what comes back
(openai_format.py). A refused request gets OpenAI's error body naming the field, with 400 (bad
value), 404 (unknown model) or 503 + Retry-After (queue full, shutting down). Routes are grouped
below by what they serve: server state, models, generation.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cb_kernels.serve import rl_routes
from cb_kernels.serve.engine_loop import Draining, EngineLoop, QueueFull, Ticket
from cb_kernels.serve.metrics import ServerMetrics
from cb_kernels.serve.openai_format import Reply
from cb_kernels.serve.prompts import Prompts
from cb_kernels.serve.protocol import (ChatRequest, CompletionRequest, RequestError, check_unsupported,
                                       error_body, prompt_error, requested_max_tokens,
                                       sampling_params, validation_error)

RETRY_AFTER_S = 1


class ServerConfig:
    def __init__(self, model_name: str, max_waiting: int = 256, drain_timeout: float = 30.0,
                 enable_rl_endpoints: bool = False):
        self.model_name, self.max_waiting, self.drain_timeout = model_name, max_waiting, drain_timeout
        self.enable_rl_endpoints = enable_rl_endpoints      # serve/rl_routes.py


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

    if config.enable_rl_endpoints:
        rl_routes.register(app, loop)
    return app


class _State:
    def __init__(self, engine, loop: EngineLoop, metrics: ServerMetrics, config: ServerConfig):
        self.engine, self.loop, self.metrics, self.config = engine, loop, metrics, config
        self.prompts = Prompts(engine.tokenizer)
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
        req = self.parse(await request.body(), schema)
        if req.model != self.config.model_name:
            raise self.unknown_model(req.model)
        check_unsupported(req)
        chat = schema is ChatRequest
        prompts = self.prompts.of(req)
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
        reply = Reply(req, tickets, chat, self.config.model_name, self.prompts.tokenizer,
                      self.loop.cancel)
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
            raise validation_error(e) from None

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
                raise RequestError(*prompt_error(str(e), where, requested_max_tokens(req)
                                                  is not None)) from None
            tickets.append(Ticket(f"{base}-{i}" if len(prompts) > 1 else base, ids, params,
                                  req.stream, index=i))
        return tickets


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


