"""Guard: the pure ASGI layer in front of the routes that refuses a request before any route
reads it.

In order: a request head (path and headers) over `max_head` bytes gets 431 (uvicorn's h11 limit
only bounds a head still incomplete); a Host header outside `allowed_hosts` gets 421 (DNS
rebinding: a page on evil.example resolving to 127.0.0.1); a missing or wrong `Authorization:
Bearer <api_key>` on a protected path gets 401 (hmac.compare_digest, constant time); a POST whose
Content-Type is not application/json gets 415 (a browser sends text/plain and form bodies
cross-site without a preflight: CSRF); a body over `max_body` bytes gets 413, from its
Content-Length before reading and, for a chunked body, as soon as the bytes read pass the cap (a
50 MB body used to be read whole). A response its client does not read for `write_timeout`
seconds is abandoned and the connection closed.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Optional

from cb_kernels.serve.protocol import RequestError, error_body

logger = logging.getLogger("cb_kernels.serve")


class _Stalled(Exception):
    """The client read nothing for write_timeout seconds."""


class Guard:
    def __init__(self, app, max_body: int, api_key: Optional[str] = None,
                 allowed_hosts: Optional[tuple] = None, protect_metrics: bool = False,
                 write_timeout: Optional[float] = None, max_head: int = 16384,
                 bodiless: frozenset = frozenset()):
        self.app, self.max_body = app, max_body
        # POST paths where an empty body needs no Content-Type: TRL's VLLMClient posts
        # /reset_prefix_cache bare, and a cross-site post there costs only prefix-cache misses
        self.bodiless = bodiless
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None
        self.open_paths = set() if protect_metrics else {"/health", "/metrics"}
        self.write_timeout, self.max_head = write_timeout, max_head

    def __getattr__(self, name):
        """The FastAPI app's attributes (state, routes, include_router, ...) through the guard."""
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + \
            sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        refused = (431, f"the request head is {head} bytes, more than {self.max_head} "
                        "(--max-header-bytes)", "headers_too_large") if head > self.max_head \
            else self.refusal(scope, headers)
        if refused is not None:
            return await _answer(send, *refused)
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return await _answer(send, *self.too_large())
        seen = 0

        async def counted_receive():       # a chunked body: refused once past the cap
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    status, text, code = self.too_large()
                    raise RequestError(text, None, status, code=code)   # the app's handler
            return message

        stalled = False

        async def timed_send(message):     # uvicorn's send waits while the client's window is full
            nonlocal stalled
            try:
                await _within(send(message), self.write_timeout)
            except asyncio.TimeoutError:
                stalled = True
                raise _Stalled() from None

        try:
            await self.app(scope, counted_receive, send if self.write_timeout is None
                           else timed_send)
        except Exception:
            if not stalled:
                raise
            # Ending here closes the connection; a stream's generator ends with it and cancels
            # its requests (openai_format.Reply.events), so their KV blocks come back.
            logger.warning("%s %s: the client read nothing for %.0f s; closed (--stream-stall-"
                           "timeout)", scope.get("method"), scope.get("path"), self.write_timeout)

    def too_large(self) -> tuple:
        return 413, f"the request body is larger than {self.max_body} bytes " \
                    "(--max-request-bytes)", "request_too_large"

    def refusal(self, scope, headers: dict):
        """(status, message, code) of a request refused before its body is read, else None."""
        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return 421, f"Host {headers.get('host', '')!r} is not served here " \
                            "(--allowed-hosts)", "misdirected_request"
        path = scope.get("path", "")
        if self.api_key is not None and path not in self.open_paths:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     self.api_key):
                return 401, "missing or wrong API key: send Authorization: Bearer <key> " \
                            "(--api-key)", "invalid_api_key"
        if scope.get("method") == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            bare = path in self.bodiless and headers.get("content-length") == "0" \
                and "transfer-encoding" not in headers
            if ctype != "application/json" and not bare:
                return 415, f"Content-Type must be application/json, got {ctype or 'none'!r}", \
                    "unsupported_media_type"
        return None


async def _within(awaitable, seconds: float):
    """await `awaitable` for at most `seconds` (asyncio.TimeoutError after): asyncio.timeout
    where there is one (3.11+: no task per call, and this runs once per stream chunk)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _host_name(host: str) -> str:
    """The name of a Host header, its port dropped ("[::1]:8000" -> "[::1]")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _answer(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error" if status != 401 else
                                 "authentication_error", None, code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
