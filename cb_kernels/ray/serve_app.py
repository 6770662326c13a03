"""serve_app: `cb-kernels serve`'s OpenAI-compatible routes as a Ray Serve application.

    from ray import serve
    from cb_kernels.ray.serve_app import serve_app

    serve.run(serve_app("smollm2-135m", replicas=4), route_prefix="/")
    # POST http://<head>:8000/v1/completions, /v1/chat/completions; GET /v1/models, /health

Each Serve replica (a Ray actor, num_cpus / num_gpus each) loads the model, builds one Engine and
serves cb_kernels.serve.routes' app on it: the same routes, request checks, error bodies and
streaming as `cb-kernels serve`, with that server's engine thread and queue limit per replica.
Ray Serve's proxy spreads the requests over the replicas. `max_ongoing_requests` is the requests
Serve lets into one replica at once: its default (5) would starve continuous batching, so it is
the engine's queue limit here. Ray Serve runs the app's lifespan, which starts and stops the
engine thread. Needs ray[serve] (in the `ray` extra).
"""
from __future__ import annotations

import os
from typing import Optional

try:
    from ray import serve
except ImportError as e:           # the extra is optional: say which one brings it
    raise ImportError("cb_kernels.ray.serve_app needs Ray Serve: pip install 'cb_kernels[ray]' "
                      f"({e})") from e


@serve.ingress()
class OpenAIReplica:
    """One Serve replica: model, Engine, the OpenAI app (built by Serve after __init__)."""

    def __init__(self, model: str, *, name: str, engine_config=None, dtype=None, device=None,
                 seed: int = 0, trust_remote_code: bool = False, torch_threads: int = 1,
                 max_waiting: int = 256, api_key=None):
        import torch

        from cb_kernels import Engine, EngineConfig, SamplingParams
        from cb_kernels.models import fast_dtype, load
        from cb_kernels.serve.routes import ServerConfig, create_app

        torch.set_num_threads(max(1, int(torch_threads)))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded, tokenizer = load(model, dtype=dtype, trust_remote_code=trust_remote_code)
        if dtype is None:
            loaded = loaded.to(fast_dtype(loaded.dtype, device)[0])
        engine = Engine(loaded.to(device), engine_config or EngineConfig(), tokenizer=tokenizer,
                        seed=seed)
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2))   # warm the first step
        self._app = create_app(engine, ServerConfig(name, max_waiting, api_key=api_key))

    def __serve_build_asgi_app__(self):
        return self._app


def serve_app(model, *, replicas: int = 1, engine_config=None, dtype: Optional[str] = None,
              device: Optional[str] = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
              served_model_name: Optional[str] = None, seed: int = 0,
              trust_remote_code: bool = False, max_waiting: int = 256, api_key=None):
    """A Ray Serve application (pass it to serve.run): `replicas` copies of `model` (a built-in
    name or a checkpoint folder readable on every node), each an Engine of `engine_config` on
    num_cpus CPUs (torch threads) / num_gpus GPUs. served_model_name: the "model" requests name
    (default: as `cb-kernels serve`, the folder's name); max_waiting: requests one replica holds
    (beyond it, 503); api_key: as `cb-kernels serve --api-key`."""
    from cb_kernels.serve.server import served_name

    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ValueError(f"model must be a built-in name or a checkpoint folder, got {model!r}")
    for label, value in (("replicas", replicas), ("max_waiting", max_waiting)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    if not num_cpus > 0:
        raise ValueError(f"num_cpus must be > 0 (torch runs on them), got {num_cpus!r}")
    tp = getattr(engine_config, "tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(f"engine_config.tensor_parallel_size={tp}: tensor parallelism inside "
                         "a Ray Serve replica is not supported yet (its server thread does not "
                         "drive follower ranks; batch replicas do: cb_kernels.ray.ProcessorConfig)"
                         "; run one Serve replica per device")
    if device == "cuda" and not num_gpus:
        raise ValueError("device='cuda' needs num_gpus > 0 (Ray gives an actor no GPU otherwise)")
    deployment = serve.deployment(
        OpenAIReplica, name="cb_kernels", num_replicas=replicas, max_ongoing_requests=max_waiting,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    return deployment.bind(
        str(model), name=served_model_name or served_name(str(model)),
        engine_config=engine_config, dtype=dtype, device=device or ("cuda" if num_gpus else "cpu"),
        seed=seed, trust_remote_code=trust_remote_code, torch_threads=max(1, int(num_cpus)),
        max_waiting=max_waiting, api_key=api_key)
