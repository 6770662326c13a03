"""The forward patch of stateful layers: inside a step each stateful module's forward is replaced
(`StateSwitch`, for the duration of the step only) by one that splits the packed row by sequence
group (the StateStep of runner/state_cache.plan, which the runner sets in this thread's
runner/forward_context.py for the forward), gathers each group's slots into what its forward reads state
through (runner/state_adapters.py), calls the module's own forward and writes the states the call
read or wrote back into the slots (a layer may have several stateful modules, each with its own
state index: Inkling). So the model's own layer code computes every state, except in layers
runner/hybrid_kernels.py has kernels for (gated delta-net, Mamba-2): those run all the step's rows
in one call on the slots in place.

Layers whose multi-token path ignores a given state (Mamba's full scan in transformers 5.24) run
`stepwise`: later prefill chunks one token at a time (runner/state_carry.py finds out at
construction).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from cb_kernels.runner import forward_context, hybrid_kernels
from cb_kernels.runner.state_adapters import (MODULE_STATE, SlotCache, gathered_layer, get_path,
                                              scatter, set_path)
from cb_kernels.runner.state_cache import StatePool, StateStep, _Group

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
        step: Optional[StateStep] = forward_context.current().state
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
            layer = gathered_layer(self.entry, g.slots, g.continuing, self.number_of_states)
            if self.held is not None:
                for kind, path in self.held:
                    set_path(self.module, path, layer.conv_states[0] if kind == "conv"
                             else layer.recurrent_states[0])
            cache = None
            if self.held is None and self.cache_name is not None:
                cache = call[self.cache_name] = SlotCache(self.layer_idx, layer)
            try:
                y = self.original(**{self.first: x}, **call)
                if self.held is not None:       # the module assigned its new states
                    for kind, path in self.held:
                        states = layer.conv_states if kind == "conv" else layer.recurrent_states
                        states[0] = get_path(self.module, path)
            finally:
                if self.held is not None:
                    for _, path in self.held:
                        set_path(self.module, path, None)
            if isinstance(y, tuple):
                y, rest = y[0], y[1:]
            if not isinstance(y, torch.Tensor) or tuple(y.shape[:2]) != tuple(x.shape[:2]):
                raise RuntimeError(f"layer {self.layer_idx}'s {type(self.module).__name__} "
                                   "does not return one row per input token")
            scatter(self.entry, layer, g.slots, self.layer_idx,
                    None if cache is None else cache.touched)
            if out is None:
                out = y.new_empty((1, n, *y.shape[2:]))
            if isinstance(g.rows, slice):
                out[:, g.rows] = y
            else:
                out[0].index_copy_(0, g.rows, y[:, 0])
        return out if rest is None else (out, *rest)


class StateSwitch(forward_context.ForwardSwap):
    """Context manager: inside it each stateful module of `modules` (layer_idx -> module) runs
    through _Wrapped, which splits the forward context's `state` (a StateStep; None: the module's
    own forward, as in the probe). Leaving restores the modules' own forwards. Not reentrant."""

    def __init__(self, modules: dict, pool: Optional[StatePool] = None, stepwise: bool = False):
        self.modules = modules
        self.pool = pool
        self._wrapped = [(m, _Wrapped(m, idx, pool)) for idx, group in modules.items()
                         for m in group]
        self.stepwise = stepwise

    @property
    def stepwise(self) -> bool:
        """Later prefill chunks run one token at a time (state_carry.check_state_carry decides)."""
        return self._stepwise

    @stepwise.setter
    def stepwise(self, value: bool) -> None:
        self._stepwise = bool(value)
        for _, w in self._wrapped:
            w.stepwise = self._stepwise

    def forwards(self):
        return self._wrapped
