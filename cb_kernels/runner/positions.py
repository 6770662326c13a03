"""Positions for models that count them themselves.

The engine tells a layer where a step's tokens are through `position_ids`. BART-style decoders
(bart, mbart, marian, pegasus, plbart, blenderbot, blenderbot-small) ignore it: their decoder
computes `arange(seq_len) + cache length` and hands that to its positional-embedding module,
whose forward takes an explicit `position_ids` as well. Inside a step (and the construction probe),
`explicit_positions(model, positions)` gives each such module an instance forward that passes
the step's positions instead; leaving restores the modules. A module it does not know keeps its
forward, and runner/attention_layers.check_positions then refuses the model as before.
"""
from __future__ import annotations

import contextlib
import inspect

import torch


def _takes_positions(module) -> bool:
    if not type(module).__name__.endswith("PositionalEmbedding") or "forward" in module.__dict__:
        return False
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    # BART-style: forward(input_ids, cache_length=0, position_ids=None), positions optional
    # (a module that requires them, as XGLM's, is handed them by its model already).
    ids = params.get("position_ids")
    return ids is not None and ids.default is None and ("cache_length" in params
                                                        or "past_key_values_length" in params)


def position_modules(model) -> list:
    """The positional-embedding modules whose positions `explicit_positions` can set."""
    return [m for m in model.modules() if _takes_positions(m)]


@contextlib.contextmanager
def explicit_positions(modules: list, positions: torch.Tensor):
    """positions: int64 [num_tokens] (or [1, num_tokens]) of the forward about to run."""
    if not modules:
        yield
        return
    flat = positions.reshape(-1)
    installed = []
    try:
        for m in modules:
            forward = type(m).forward.__get__(m)
            sig = inspect.signature(forward)

            def run(*args, _forward=forward, _sig=sig, **kwargs):
                bound = _sig.bind(*args, **kwargs)
                given = bound.arguments.get("position_ids")
                # The step's positions in the shape the caller computed its own in.
                bound.arguments["position_ids"] = flat.view(given.shape) \
                    if isinstance(given, torch.Tensor) and given.numel() == flat.numel() else flat
                return _forward(*bound.args, **bound.kwargs)
            m.forward = run
            installed.append(m)
        yield
    finally:
        for m in installed:
            m.__dict__.pop("forward", None)
