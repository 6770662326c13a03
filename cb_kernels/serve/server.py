"""`cb-kernels serve --model NAME_OR_DIR`: load the model, start the engine thread, serve HTTP.

SIGTERM (or Ctrl-C) stops admission at once: new requests get 503 and the listening socket
closes; requests already accepted have --drain-timeout seconds to finish, then the rest end with
finish_reason "cancelled" (a second signal cancels them at once); then the process exits with 0.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys

REQUIRED = ("fastapi", "uvicorn", "prometheus_client", "pydantic")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from cb_kernels.generate_cli import add_engine_args

    p.add_argument("--model", required=True, help="built-in name (smollm2-135m) or checkpoint folder")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free one, "
                   "printed when ready)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: the fastest here for the checkpoint, "
                        "cb_kernels.models.fast_dtype)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint run its own code")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests accepted but not yet scheduled; past it: 503 + Retry-After")
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
    name = args.served_model_name or args.model
    port = sock.getsockname()[1]

    def ready():
        print(f"cb-kernels serve: {name} on http://{args.host}:{port} (ready)", file=sys.stderr,
              flush=True)

    app = create_app(engine, ServerConfig(name, args.max_waiting, args.drain_timeout,
                                          args.enable_rl_endpoints), ready)
    server = _Server(uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                    timeout_graceful_shutdown=args.drain_timeout + 10,
                                    lifespan="on"),
                     app.state.serve.loop, args.drain_timeout)
    server.run(sockets=[sock])
    return 0


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
