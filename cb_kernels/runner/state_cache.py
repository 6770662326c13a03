"""Per-sequence state of stateful layers (state-space, gated delta-net, short convolutions, linear
attention), kept in slots beside the paged KV cache.

Which layers: every module whose class source calls transformers' linear-attention cache
interface (`cache.get_conv_state` / `get_recurrent_state` / `update_*_state`, transformers 5.x's
one interface for Mamba, Mamba2, gated delta-net, short-conv, ... mixers) and has an int
`layer_idx` (`state_modules`). Their state shapes come from one probe forward of the model's own
code with transformers' DynamicCache (`probe_specs`): per layer and state index a conv window
[channels, kernel] and/or a recurrent state [...], per sequence.

The pool (`StatePool`): per layer, state kind and state index one tensor [num_slots, *shape]; a
running sequence owns one slot (the same index in every tensor). The engine's StateSlots
(engine/state_slots.py) hands slots out and moves them (swap, fork copy) through `tensors`.

A step: transformers' forward runs on one packed row of every scheduled sequence's new tokens.
Inside it each stateful module's forward is replaced (`StateSwitch`, for the duration of the
step only) by one that splits the row by sequence (`StateStep`, built by `plan` with the step's
inputs), gathers the sequences' slots into a transformers `LinearAttentionLayer` behind a small
cache object (`_SlotCache`) and calls the module's own forward on it:
  * all decoding sequences (one new token after earlier ones) together, as a [B, 1, H] batch;
  * each prefill or prefill chunk alone, as [1, n, H]: from zero state when it starts at token 0
    (the layer's prefill path), else from its slot (a later chunk: the cache-continuation path);
then writes the states the call read or wrote back into the slots (a layer may have several
stateful modules, each with its own state index: Inkling). So the model's own layer code
computes every state, except in layers runner/hybrid_kernels.py has kernels for (gated
delta-net, Mamba-2): those run all the step's rows in one call on the slots in place.

Also handled: MiniMax's lightning attention (`get_linear_cache` / `set_linear_cache`: one state
per layer, kept as recurrent state 0); blocks that keep their state on the module rather than in
a cache (`MODULE_STATE`, RecurrentGemma's recurrent block: the wrapper sets the attributes from
the slots around each call with use_cache=True and reads them back); layers whose multi-token
path ignores a given state (Mamba's full scan in transformers 5.24: `stepwise`, later prefill
chunks then run one token at a time; support.check_state_carry finds out at construction).
"""
from __future__ import annotations

import contextlib
import inspect
import re
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from cb_kernels.runner import hybrid_kernels

_STATE_CALLS = (".get_conv_state(", ".get_recurrent_state(", ".update_conv_state(",
                ".update_recurrent_state(",
                ".get_linear_cache(")     # MiniMax's lightning attention (MiniMaxCache)
_SOURCE_USES_STATE: dict = {}       # class -> bool
# Stateful blocks that keep their state on the module instead of a cache (class name -> the
# attribute paths of its conv window and recurrent state). RecurrentGemma's recurrent block: its
# forward with use_cache=True continues from `conv1d_state` and `rg_lru.recurrent_states`.
MODULE_STATE = {
    "RecurrentGemmaRecurrentBlock": (("conv", "conv1d_state"),
                                     ("recurrent", "rg_lru.recurrent_states")),
}
_LAYER_OF_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_CURRENT = threading.local()        # the StateStep of the forward running in this thread


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
            states = {kind: _get_path(first, path) for kind, path in held}
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


class StatePool:
    """The slots: per layer, kind and state index a tensor [num_slots, *shape] (zeros)."""

    def __init__(self, specs: dict, num_slots: int, device: torch.device):
        self.specs = specs
        self.num_slots = num_slots
        self.by_layer: dict = {}       # layer_idx -> {(kind, si): tensor}
        self.tensors: list = []        # every pool tensor, for the engine's copies
        for idx, spec in specs.items():
            entry = {}
            for kind, si, (shape, dtype) in spec.entries():
                t = torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                entry[(kind, si)] = t
                self.tensors.append(t)
            self.by_layer[idx] = entry

    @staticmethod
    def bytes_per_slot(specs: dict) -> int:
        total = 0
        for spec in specs.values():
            for _, _, (shape, dtype) in spec.entries():
                n = 1
                for d in shape:
                    n *= d
                total += n * torch.empty((), dtype=dtype).element_size()
        return total


# -- one step -----------------------------------------------------------------------------------
@dataclass
class _Group:
    """Sequences one module call runs: rows of the packed step (a slice for one prefill, an
    index tensor for the decode batch), their slots, and whether they continue from a state."""

    rows: object                      # slice | int64 tensor [B]
    slots: torch.Tensor               # int64 [B]
    continuing: bool


@dataclass
class StateStep:
    groups: list = field(default_factory=list)
    num_tokens: int = 0
    varlen: Optional[object] = None   # hybrid_kernels.VarlenRows, built once by the first layer


def plan(seqs: list, num_new_tokens: list, device: torch.device) -> StateStep:
    """The groups of one step (see the module docstring). Every sequence must hold a slot
    (seq.state_slot >= 0; the engine's StateSlots gave it one at admission)."""
    step = StateStep()
    dec_rows, dec_slots, row = [], [], 0
    for seq, n in zip(seqs, num_new_tokens):
        slot = seq.state_slot
        if slot < 0:
            raise RuntimeError(f"{seq} runs a stateful model without a state slot")
        start = seq.num_computed_tokens
        if n == 1 and start > 0:
            dec_rows.append(row)
            dec_slots.append(slot)
        else:
            step.groups.append(_Group(slice(row, row + n),
                                      torch.tensor([slot], dtype=torch.int64, device=device),
                                      start > 0))
        row += n
    if dec_rows:
        step.groups.insert(0, _Group(torch.tensor(dec_rows, dtype=torch.int64, device=device),
                                     torch.tensor(dec_slots, dtype=torch.int64, device=device),
                                     True))
    step.num_tokens = row
    return step


class _SlotCache:
    """What a stateful layer's forward calls on its `cache` argument, for one layer and one group:
    backed by a transformers LinearAttentionLayer whose states are the group's gathered slots."""

    def __init__(self, layer_idx: int, layer):
        self.layer_idx = layer_idx
        self.layer = layer
        self.touched: set = set()   # (kind, state_idx) read or written: what goes back to slots

    def _check(self, layer_idx):
        if layer_idx != self.layer_idx:
            raise RuntimeError(f"layer {self.layer_idx}'s module asked for layer {layer_idx}'s "
                               "state")

    def get_conv_state(self, layer_idx, state_idx=0):
        self._check(layer_idx)
        if self.layer.has_previous_state[state_idx]:
            self.touched.add(("conv", state_idx))     # a decode updates it in place
            return self.layer.conv_states[state_idx]
        return None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        self._check(layer_idx)
        if self.layer.has_previous_state[state_idx]:
            self.touched.add(("recurrent", state_idx))
            return self.layer.recurrent_states[state_idx]
        return None

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        """The window the layer convolves next, contiguous: the layers hand in a transposed
        slice of their projection, on which torch's CPU depthwise conv1d takes a slow path
        (32 ms against 0.064 ms for [1, 512, 103], same bits, 2 threads)."""
        self._check(layer_idx)
        self.touched.add(("conv", state_idx))
        return self.layer.update_conv_state(conv_states, state_idx, **kwargs).contiguous()

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self._check(layer_idx)
        self.touched.add(("recurrent", state_idx))
        return self.layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    @property
    def layers(self):
        """transformers 5.17's layers read their states as `cache.layers[layer_idx].conv_states[i]`
        (and `.recurrent_states`, `.record_past`) where 5.24's call get_conv_state; a decode then
        updates the conv window in place, so every state the layer holds goes back to its slot."""
        return _LayerIndex(self)

    def has_previous_state(self, layer_idx=None, state_idx=None):
        if state_idx is None:
            return all(self.layer.has_previous_state.values())
        return self.layer.has_previous_state[state_idx]

    def is_recording_past(self, layer_idx=None) -> bool:
        return False

    # MiniMaxCache's interface: the layer's one state is recurrent state 0.
    def get_linear_cache(self, layer_idx):
        return self.get_recurrent_state(layer_idx, 0)

    def set_linear_cache(self, layer_idx, linear_cache):
        self._check(layer_idx)
        self.touched.add(("recurrent", 0))
        self.layer.update_recurrent_state(linear_cache, 0)
        self.layer.has_previous_state[0] = True


class _LayerIndex:
    """`_SlotCache.layers`: the gathered layer at its own index, the states it holds marked
    touched."""

    def __init__(self, cache: _SlotCache):
        self.cache = cache

    def __getitem__(self, layer_idx):
        cache = self.cache
        cache._check(layer_idx)
        layer = cache.layer
        for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            cache.touched.update((kind, si) for si, t in states.items()
                                 if t is not None and layer.has_previous_state[si])
        return layer


def _gathered_layer(entry: dict, slots: torch.Tensor, continuing: bool, number_of_states: int):
    """A LinearAttentionLayer holding the group's states: copies of its slots when it continues,
    zeros when it starts at token 0 (the layer's prefill path then fills them)."""
    from transformers.cache_utils import LinearAttentionLayer

    layer = LinearAttentionLayer(number_of_states=number_of_states)
    for (kind, si), pool in entry.items():
        if continuing:
            state = pool.index_select(0, slots)
        else:
            state = pool.new_zeros((slots.shape[0], *pool.shape[1:]))
        if kind == "conv":
            layer.conv_states[si] = state
            layer.is_conv_states_initialized[si] = True
            layer.conv_kernel_size[si] = state.shape[-1]
        else:
            layer.recurrent_states[si] = state
            layer.is_recurrent_states_initialized[si] = True
        layer.has_previous_state[si] = continuing
        layer.dtype, layer.device = state.dtype, state.device
    return layer


def _scatter(entry: dict, layer, slots: torch.Tensor, layer_idx: int,
             only: Optional[set] = None) -> None:
    """The group's states back into its slots; `only`: the (kind, state_idx) the call touched
    (None: all), so a layer's other modules' states stay as they are."""
    for (kind, si), pool in entry.items():
        if only is not None and (kind, si) not in only:
            continue
        state = (layer.conv_states if kind == "conv" else layer.recurrent_states)[si]
        if state is None or tuple(state.shape) != (slots.shape[0], *pool.shape[1:]):
            raise RuntimeError(
                f"layer {layer_idx}'s {kind} state {si} came back with shape "
                f"{None if state is None else tuple(state.shape)}, its slots hold "
                f"{tuple(pool.shape[1:])} per sequence")
        pool.index_copy_(0, slots, state.to(pool.dtype))


def _get_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _set_path(obj, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)


_CACHE_NAMES = ("cache", "cache_params", "past_key_values")


class _Wrapped:
    """The replacement forward of one stateful module (see the module docstring). Outside an
    engine step (the construction probe) it runs the module's own forward with no cache.
    Arguments are passed on by name, and only those the module's forward names (not the
    engine's cbk_step, which a decoder layer's **kwargs would hand down); per-token tensors
    ([1, num_tokens, ...], e.g. position_ids) are split by sequence like the hidden states."""

    def __init__(self, module, layer_idx: int, pool: Optional[StatePool]):
        self.module = module
        self.pool = pool
        fn = type(module).forward
        self.original = fn.__get__(module)
        params = [p for n, p in inspect.signature(fn).parameters.items() if n != "self"]
        self.positional = [p.name for p in params
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.named = {p.name for p in params
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        self.cache_name = next((n for n in _CACHE_NAMES if n in self.named), None)
        self.first = self.positional[0] if self.positional else None
        self.layer_idx = layer_idx
        self.held = MODULE_STATE.get(type(module).__name__)    # state kept on the module
        entry = pool.by_layer.get(self.layer_idx) if pool is not None else None
        self.entry = entry
        self.number_of_states = 1 + max((si for _, si in entry), default=0) if entry else 1
        self.stepwise = False      # later prefill chunks one token at a time (StateSwitch)
        # One call for all rows on cb_kernels' ops where the layer maps onto them.
        self.kernel, self.kernel_reason = (hybrid_kernels.kernel_for(module, entry)
                                           if pool is not None else (None, "no state pool"))

    def _groups(self, step: StateStep):
        for g in step.groups:
            rows = g.rows
            if self.stepwise and g.continuing and isinstance(rows, slice) \
                    and rows.stop - rows.start > 1:
                for r in range(rows.start, rows.stop):
                    yield _Group(slice(r, r + 1), g.slots, True)
            else:
                yield g

    def __call__(self, *args, **kwargs):
        if len(args) > len(self.positional):
            raise TypeError(f"{type(self.module).__name__}.forward got {len(args)} positional "
                            "arguments")
        kwargs = {**dict(zip(self.positional, args)), **kwargs}
        kwargs = {k: v for k, v in kwargs.items() if k in self.named and k not in _CACHE_NAMES}
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None     # the engine's rows hold no padding
        step: Optional[StateStep] = getattr(_CURRENT, "step", None)
        if step is None or self.entry is None:
            return self.original(**kwargs)
        hidden_states = kwargs.pop(self.first)
        n = step.num_tokens
        if hidden_states.shape[0] != 1 or hidden_states.shape[1] != n:
            raise RuntimeError(f"layer {self.layer_idx} got hidden states "
                               f"{tuple(hidden_states.shape)}, not the step's packed row "
                               f"[1, {n}, ...]")
        if self.kernel is not None:
            return self.kernel(hidden_states, hybrid_kernels.varlen_rows(step))
        per_token = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)
                     and v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == n}
        if self.held is not None:
            kwargs["use_cache"] = True
        out = rest = None
        for g in self._groups(step):
            def rows_of(t):
                if isinstance(g.rows, slice):
                    return t[:, g.rows]
                return t[0].index_select(0, g.rows)[:, None]

            x = rows_of(hidden_states)
            call = {k: rows_of(v) if k in per_token else v for k, v in kwargs.items()}
            layer = _gathered_layer(self.entry, g.slots, g.continuing, self.number_of_states)
            if self.held is not None:
                for kind, path in self.held:
                    _set_path(self.module, path, layer.conv_states[0] if kind == "conv"
                              else layer.recurrent_states[0])
            cache = None
            if self.held is None and self.cache_name is not None:
                cache = call[self.cache_name] = _SlotCache(self.layer_idx, layer)
            try:
                y = self.original(**{self.first: x}, **call)
                if self.held is not None:       # the module assigned its new states
                    for kind, path in self.held:
                        states = layer.conv_states if kind == "conv" else layer.recurrent_states
                        states[0] = _get_path(self.module, path)
            finally:
                if self.held is not None:
                    for _, path in self.held:
                        _set_path(self.module, path, None)
            if isinstance(y, tuple):
                y, rest = y[0], y[1:]
            if not isinstance(y, torch.Tensor) or tuple(y.shape[:2]) != tuple(x.shape[:2]):
                raise RuntimeError(f"layer {self.layer_idx}'s {type(self.module).__name__} "
                                   "does not return one row per input token")
            _scatter(self.entry, layer, g.slots, self.layer_idx,
                     None if cache is None else cache.touched)
            if out is None:
                out = y.new_empty((1, n, *y.shape[2:]))
            if isinstance(g.rows, slice):
                out[:, g.rows] = y
            else:
                out[0].index_copy_(0, g.rows, y[:, 0])
        return out if rest is None else (out, *rest)


class StateSwitch:
    """Context manager: inside it each stateful module of `modules` (layer_idx -> module) runs
    through _Wrapped; `step` (a StateStep, or None for the probe) is the step it splits. Leaving
    restores the modules' own forwards. Not reentrant per module."""

    def __init__(self, modules: dict, pool: Optional[StatePool] = None, stepwise: bool = False):
        self.modules = modules
        self.pool = pool
        self._wrapped = [(m, _Wrapped(m, idx, pool)) for idx, group in modules.items()
                         for m in group]
        self.stepwise = stepwise

    @property
    def stepwise(self) -> bool:
        """Later prefill chunks run one token at a time (support.check_state_carry decides)."""
        return self._stepwise

    @stepwise.setter
    def stepwise(self, value: bool) -> None:
        self._stepwise = bool(value)
        for _, w in self._wrapped:
            w.stepwise = self._stepwise

    @contextlib.contextmanager
    def __call__(self, step: Optional[StateStep]):
        saved = []
        for module, wrapped in self._wrapped:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = wrapped
        prev = getattr(_CURRENT, "step", None)
        _CURRENT.step = step
        try:
            yield
        finally:
            _CURRENT.step = prev
            for module, forward in saved:
                if forward is _MISSING:
                    del module.forward
                else:
                    module.forward = forward


_MISSING = object()
