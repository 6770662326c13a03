"""`cb-kernels serve --model NAME_OR_DIR`: load the model, start the engine thread, serve HTTP.

SIGTERM (or Ctrl-C) stops admission at once: new requests get 503 and the listening socket
closes; requests already accepted have --drain-timeout seconds to finish, then the rest end with
finish_reason "cancelled" (a second signal cancels them at once); then the process exits with 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

REQUIRED = ("fastapi", "uvicorn", "prometheus_client", "pydantic")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from cb_kernels.generate_cli import add_engine_args

    p.add_argument("--model", required=True, help="built-in name (smollm2-135m) or checkpoint folder")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model's last path part, "
                        "so a checkpoint's folder name, never its full path)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free one, "
                   "printed when ready)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: the fastest here for the checkpoint, "
                        "cb_kernels.models.fast_dtype)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint run its own code")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences (prompts x n) accepted but not yet scheduled; past it: 503 + "
                        "Retry-After")
    p.add_argument("--max-request-seqs", type=int, default=256,
                   help="prompts x n of one request (default 256); more: 400")
    p.add_argument("--max-request-tokens", type=int, default=1 << 20,
                   help="prompts x n x max_tokens of one request (default 1048576); more: 400")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="request body size in bytes (default 8388608 = 8 MiB); more: 413")
    p.add_argument("--stream-buffer", type=int, default=256,
                   help="chunks a stream holds for a client that does not read them (default "
                        "256); past it the stream is paused")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="seconds a paused stream waits for its client to read (default 30); "
                        "then its request is cancelled and its KV blocks freed")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 route (default: the "
                        "CBK_API_KEY environment variable; unset: no key)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="with --api-key: /health and /metrics need the key too")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names accepted (others: 421); default: "
                        "localhost,127.0.0.1,::1 when bound to a loopback address, any otherwise; "
                        "'*' accepts any")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections + tasks at once; past it: 503 (default 1024)")
    p.add_argument("--request-head-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a whole request head (default 10); "
                        "then it is closed (a client dripping a header byte at a time)")
    p.add_argument("--max-header-bytes", type=int, default=16384,
                   help="bytes of a request head (default 16384); more: 431 (400 while the "
                        "head is still incomplete: uvicorn's h11_max_incomplete_event_size)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (then cancelled)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampled requests without their own")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--enable-rl-endpoints", action="store_true",
                   help="add vLLM's RL routes: /sleep, /wake_up, /pause, /resume, /update_weights, "
                        "... (serve/rl_routes.py; anyone who reaches the port can use them)")
    add_engine_args(p)


def _missing() -> list:
    import importlib.util

    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


def run_serve(args: argparse.Namespace) -> int:
    missing = _missing()
    if missing:
        raise SystemExit(f"cb-kernels serve needs {', '.join(missing)}: pip install "
                         "\"cb_kernels[serve]\"")
    if args.max_waiting < 1:
        raise SystemExit(f"--max-waiting must be >= 1, got {args.max_waiting}")
    for flag in ("max_request_seqs", "max_request_tokens", "max_request_bytes", "stream_buffer",
                 "limit_concurrency", "max_header_bytes"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("stream_stall_timeout", "timeout_keep_alive", "request_head_timeout"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.drain_timeout < 0:
        raise SystemExit(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"--port must be in [0, 65535], got {args.port}")
    import torch
    import uvicorn

    from cb_kernels import Engine, SamplingParams
    from cb_kernels.generate_cli import engine_config
    from cb_kernels.models import fast_dtype, load
    from cb_kernels.serve.routes import ServerConfig, create_app

    try:
        config = engine_config(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"bad option: {e}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    # Bind first: a port in use is reported before the model loads.
    try:
        sock = socket.create_server((args.host, args.port), backlog=2048)
    except OSError as e:
        raise SystemExit(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        model, tokenizer = load(args.model, dtype=args.dtype,
                                trust_remote_code=args.trust_remote_code)
    except (ValueError, TypeError, OSError) as e:     # not a built-in name nor a checkpoint, ...
        sock.close()
        raise SystemExit(f"--model {args.model}: {e}") from None
    if args.dtype is None:
        dtype, why = fast_dtype(model.dtype, device)
        print(f"dtype: {str(dtype).replace('torch.', '')} ({why})", file=sys.stderr)
        model = model.to(dtype)
    engine = Engine(model.to(device), config, tokenizer=tokenizer, seed=args.seed)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2))   # warm up the first step
    name = args.served_model_name or served_name(args.model)
    port = sock.getsockname()[1]
    api_key = args.api_key or os.environ.get("CBK_API_KEY") or None
    loopback = is_loopback(args.host)
    if not loopback and api_key is None:
        logging.getLogger("cb_kernels.serve").warning(
            "listening on %s, which is not a loopback address, with no API key: anyone who can "
            "reach it can generate; set --api-key or CBK_API_KEY", args.host)

    def ready():
        print(f"cb-kernels serve: {name} on http://{args.host}:{port} (ready)", file=sys.stderr,
              flush=True)

    server_config = ServerConfig(
        name, args.max_waiting, args.drain_timeout, args.enable_rl_endpoints,
        max_request_seqs=args.max_request_seqs, max_request_tokens=args.max_request_tokens,
        max_request_bytes=args.max_request_bytes, api_key=api_key,
        allowed_hosts=allowed_hosts(args.allowed_hosts, loopback),
        protect_metrics=args.protect_metrics, stream_buffer=args.stream_buffer,
        stream_stall_timeout=args.stream_stall_timeout, max_header_bytes=args.max_header_bytes)
    app = create_app(engine, server_config, ready)
    server = _Server(uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                    timeout_graceful_shutdown=args.drain_timeout + 10,
                                    timeout_keep_alive=args.timeout_keep_alive,
                                    limit_concurrency=args.limit_concurrency,
                                    h11_max_incomplete_event_size=args.max_header_bytes,
                                    http=head_timeout_protocol(args.request_head_timeout),
                                    lifespan="on"),
                     app.state.serve.loop, args.drain_timeout)
    server.run(sockets=[sock])
    return 0


def served_name(model: str) -> str:
    """The default served model name: a checkpoint folder's name, not its path (the path showed
    in every response and 404)."""
    return os.path.basename(os.path.normpath(model)) or model


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(flag, loopback: bool):
    """The Host names accepted (None: any)."""
    if flag is None:
        return ("localhost", "127.0.0.1", "[::1]") if loopback else None
    names = tuple(h.strip() for h in flag.split(",") if h.strip())
    if "*" in names:
        return None
    return tuple(f"[{h}]" if ":" in h and not h.startswith("[") else h for h in names)


def head_timeout_protocol(timeout: float):
    """uvicorn's h11 protocol with a deadline for each request head: uvicorn has none (its
    keep-alive timer stops at the first byte), so a client sending a header byte at a time held
    its connection for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            self._arm_head_deadline()        # first: a pipelined next request disarms it
            super().on_response_complete()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._head_cycle and self._head_timer is not None:
                self._head_timer.cancel()          # a whole head arrived
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if getattr(self, "_head_timer", None) is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGTERM/SIGINT also drains the engine (and, unlike uvicorn's,
        does not re-raise the signal after the clean shutdown, so the exit status is 0)."""

        def __init__(self, config, loop, drain_timeout: float):
            super().__init__(config)
            self.engine_loop, self.drain_timeout = loop, drain_timeout

        def handle_exit(self, sig, frame) -> None:
            self.engine_loop.drain(self.drain_timeout)
            self.should_exit = True

    return Server


def _Server(config, loop, drain_timeout):
    return _server_class()(config, loop, drain_timeout)
