"""The RL routes of `cb-kernels serve --enable-rl-endpoints` (off by default), with vLLM's names
and payloads (README, "RL"; what clients send: /work/shared/notes/rl-clients.md):

    POST /sleep?level=1|2[&mode=wait|abort]   {"bytes_freed": N}
    POST /wake_up[?tags=weights&tags=kv_cache]
    GET  /is_sleeping                         {"is_sleeping": bool}
    POST /pause?mode=keep|wait|abort          (vLLM's default: abort)
    POST /resume
    GET  /is_paused                           {"is_paused": bool}
    POST /reset_prefix_cache                  {"success": true}; no body needed (TRL posts none)
    POST /update_weights {"weight_dir": DIR}  safetensors only; {"weight_version": N}
    GET  /weight_info                         {"weight_version", "dtype", "num_parameters"}
    GET  /get_world_size                      {"world_size": N}

Each runs on the engine thread between two steps (EngineLoop.call). A bad value answers 400 with
OpenAI's error body naming it; what the engine refuses (sleep with requests and no mode, say)
answers 409.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

from fastapi import Body, FastAPI, Query

from cb_kernels.serve.protocol import RequestError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Posted with no body and no Content-Type by TRL's VLLMClient (guard.Guard lets these through)
BODILESS = frozenset({"/reset_prefix_cache"})


def read_weight_dir(weight_dir) -> dict:
    """name -> tensor of every *.safetensors file in `weight_dir`. Pickle weights are refused (as
    models.load refuses them: unpickling runs code); ValueError names the problem."""
    from safetensors.torch import load_file

    if not isinstance(weight_dir, str) or not weight_dir:
        raise ValueError(f"weight_dir must be a folder path, got {weight_dir!r}")
    path = Path(weight_dir)
    if not path.is_dir():
        raise ValueError(f"weight_dir: {path} is not a folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        raise ValueError(f"weight_dir: {path} has no *.safetensors weights"
                         + (f" (only pickle weights, refused: {', '.join(pickled)})"
                            if pickled else ""))
    tensors: dict = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:       # noqa: BLE001 (safetensors' own error types)
            raise ValueError(f"weight_dir: {f.name} is not a readable safetensors file "
                             f"({e})") from None
    return tensors


def _missing(model, tensors: dict) -> list:
    """Parameters no name in `tensors` covers (a tied weight is covered by either name)."""
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [ns[0] for ns in names.values() if not any(n in tensors for n in ns)]


def _update_from_dir(engine, weight_dir) -> int:
    tensors = read_weight_dir(weight_dir)
    missing = _missing(engine.model, tensors)
    if missing:
        raise ValueError(f"weight_dir: {weight_dir} lacks {len(missing)} of the model's weights "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    return engine.update_weights(tensors.items())


def register(app: FastAPI, loop) -> None:
    """Add the routes to `app`, each calling the Engine on `loop`'s thread."""

    async def on_engine(fn):
        try:
            return await asyncio.wrap_future(loop.call(fn))
        except (ValueError, TypeError) as e:
            raise RequestError(f"{e}", param=None) from None
        except (RuntimeError, NotImplementedError) as e:
            raise RequestError(f"{e}", status=409, code="conflict") from None

    @app.post("/sleep")
    async def sleep(level: int = Query(1), mode: Optional[str] = Query(None)):
        freed = await on_engine(lambda e: e.sleep(level=level, mode=mode))
        return {"bytes_freed": freed}

    @app.post("/wake_up")
    async def wake_up(tags: Optional[list[str]] = Query(None)):
        await on_engine(lambda e: e.wake_up(tags))
        return {}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await on_engine(lambda e: e.is_sleeping)}

    @app.post("/pause")
    async def pause(mode: str = Query("abort")):
        # the aborted outputs reach their clients through the next step() (EngineLoop)
        await on_engine(lambda e: e.defer(e.pause(mode)))
        return {}

    @app.post("/resume")
    async def resume():
        await on_engine(lambda e: e.resume())
        return {}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await on_engine(lambda e: e.is_paused)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await on_engine(lambda e: e.reset_prefix_cache())
        return {"success": True}          # vLLM's answer since 0.26

    @app.post("/update_weights")
    async def update_weights(body: dict = Body(...)):
        unknown = sorted(set(body) - {"weight_dir"})
        if unknown or "weight_dir" not in body:
            raise RequestError(f"update_weights takes {{\"weight_dir\": DIR}}, got fields "
                               f"{sorted(body)}", param=(unknown or ["weight_dir"])[0])
        version = await on_engine(lambda e: _update_from_dir(e, body["weight_dir"]))
        return {"weight_version": version}

    @app.get("/weight_info")
    async def weight_info():
        def info(e):
            params = list(e.model.parameters())
            return {"weight_version": e.weight_version,
                    "dtype": str(params[0].dtype).replace("torch.", "") if params else None,
                    "num_parameters": sum(p.numel() for p in params)}
        return await on_engine(info)

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": await on_engine(lambda e: e.stats()["tensor_parallel_size"])}
