"""Which layers keep per-sequence state (state-space, gated delta-net, short convolutions, linear
attention), and its shape per sequence, found once at construction.

Which layers: every module whose class source calls transformers' linear-attention cache
interface (`cache.get_conv_state` / `get_recurrent_state` / `update_*_state`, transformers 5.x's
one interface for Mamba, Mamba2, gated delta-net, short-conv, ... mixers; MiniMax's
`get_linear_cache`) and has an int `layer_idx`, plus the blocks of runner/state_adapters.py's
MODULE_STATE (`state_modules`). Their state shapes come from one probe forward of the model's own
code with transformers' DynamicCache (`probe_specs`): per layer and state index a conv window
[channels, kernel] and/or a recurrent state [...], per sequence.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

from cb_kernels.runner.state_adapters import MODULE_STATE, get_path

_STATE_CALLS = (".get_conv_state(", ".get_recurrent_state(", ".update_conv_state(",
                ".update_recurrent_state(",
                ".get_linear_cache(")     # MiniMax's lightning attention (MiniMaxCache)
_SOURCE_USES_STATE: dict = {}       # class -> bool
_LAYER_OF_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _uses_state_interface(cls) -> bool:
    """Whether the source of `cls` or of a class it derives from calls the cache's state
    interface (a subclass that wraps a transformers mixer's forward keeps its state through it)."""
    hit = _SOURCE_USES_STATE.get(cls)
    if hit is None:
        hit = False
        if not cls.__module__.startswith("torch."):
            try:
                src = inspect.getsource(cls)
            except (OSError, TypeError):
                src = ""
            hit = any(call in src for call in _STATE_CALLS) \
                or any(_uses_state_interface(base) for base in cls.__bases__)
        _SOURCE_USES_STATE[cls] = hit
    return hit


def state_modules(model) -> dict:
    """layer_idx -> the modules of `model` that keep that layer's recurrent / conv state through
    transformers' cache interface (a list: Inkling has four short convolutions per layer, each
    with its own state index). Raises ValueError for a stateful module inside another one (the
    outer one would split the rows first) or one without a layer index. Empty on a transformers
    without LinearAttentionLayer (what the slots are gathered into): such a model's stateful
    layers are then refused by support.static_check."""
    try:
        from transformers.cache_utils import LinearAttentionLayer  # noqa: F401
    except ImportError:
        return {}
    out: dict = {}
    for name, module in model.named_modules():
        if type(module).__name__ in MODULE_STATE:
            m = _LAYER_OF_NAME.search(name)
            if m is None:
                raise ValueError(f"stateful module {name} ({type(module).__name__}) is in no "
                                 "numbered layer")
            out.setdefault(int(m.group(1)), []).append(module)
            continue
        if not _uses_state_interface(type(module)):
            continue
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ValueError(f"stateful module {name} ({type(module).__name__}) has no int "
                             "layer_idx")
        out.setdefault(idx, []).append(module)
    found = all_modules(out)
    for module in found:
        inner = [m for m in module.modules() if m is not module and m in found]
        if inner:
            raise ValueError(f"stateful module {type(inner[0]).__name__} sits inside another "
                             f"one ({type(module).__name__})")
    return out


def all_modules(modules: dict) -> list:
    """Every module of a state_modules map, flat."""
    return [m for group in modules.values() for m in group]


@dataclass(frozen=True)
class LayerStateSpec:
    """One stateful layer: conv[state_idx] and recurrent[state_idx] = (per-sequence shape,
    dtype)."""

    conv: dict
    recurrent: dict

    def entries(self):
        for kind, states in (("conv", self.conv), ("recurrent", self.recurrent)):
            for si in sorted(states):
                yield kind, si, states[si]


def _find_cache(output):
    from transformers.cache_utils import Cache

    for key in ("cache", "past_key_values", "cache_params"):
        value = getattr(output, key, None)
        if isinstance(value, Cache):
            return value
    if isinstance(output, dict):
        for value in output.values():
            if isinstance(value, Cache):
                return value
    return None


def probe_specs(model, modules: dict, num_tokens: int = 6) -> dict:
    """layer_idx -> LayerStateSpec, read off the DynamicCache of one forward of `num_tokens`
    tokens with the model's own attention and cache (what generate() runs). Raises RuntimeError
    naming the problem if that forward fails or leaves no state for a layer."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(num_tokens, device=device)[None] * 7 + 3) % vocab
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    cache = _find_cache(out)
    if cache is None and not all(type(m).__name__ in MODULE_STATE
                                 for m in all_modules(modules)):
        raise RuntimeError("its forward with use_cache=True returns no transformers Cache")
    specs = {}
    for idx in sorted(modules):
        first = modules[idx][0]
        held = MODULE_STATE.get(type(first).__name__)
        if held is not None:
            if len(modules[idx]) > 1:
                raise RuntimeError(f"layer {idx} has {len(modules[idx])} stateful blocks")
            states = {kind: get_path(first, path) for kind, path in held}
            if any(not isinstance(t, torch.Tensor) for t in states.values()):
                raise RuntimeError(f"layer {idx} ({type(first).__name__}) holds no "
                                   "state after a forward with use_cache=True")
            specs[idx] = LayerStateSpec(
                {0: (tuple(states["conv"].shape[1:]), states["conv"].dtype)},
                {0: (tuple(states["recurrent"].shape[1:]), states["recurrent"].dtype)})
            continue
        layer = cache.layers[idx] if idx < len(cache.layers) else None
        conv = {si: (tuple(t.shape[1:]), t.dtype)
                for si, t in (getattr(layer, "conv_states", None) or {}).items() if t is not None}
        rec = {si: (tuple(t.shape[1:]), t.dtype)
               for si, t in (getattr(layer, "recurrent_states", None) or {}).items()
               if t is not None}
        linear = getattr(cache, "linear_cache", None)      # MiniMaxCache: one state per layer
        if not conv and not rec and linear is not None and idx < len(linear) \
                and isinstance(linear[idx], torch.Tensor):
            rec = {0: (tuple(linear[idx].shape[1:]), linear[idx].dtype)}
        if not conv and not rec:
            raise RuntimeError(f"layer {idx} ({type(first).__name__}) left no state in "
                               "transformers' cache")
        specs[idx] = LayerStateSpec(conv, rec)
    return specs
