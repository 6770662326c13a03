"""What the hooks inside transformers' forward read about the forward they run in: one object per
thread (`current()`), set by the runner for a step (`entered(...)`) and restored after.

The runner changes the model for one forward (our attention name, per-call layer indices,
explicit positions, packed linears, the stateful layers' wrappers, the tensor-parallel
collectives); the functions it installs there are called by transformers' own code, which hands
them only what its signatures carry. What else they need travels here:
  * attn: the step's AttentionMetadata, for decoder layers that drop the `cbk_step` kwarg
    (stablelm, nemotron; runner/attention.py reads the kwarg first);
  * state: the step's StateStep, the split by sequence the stateful layers' wrappers run
    (runner/state_switch.py);
  * recording: the construction probe's Recording (runner/probe.py);
  * tp_local: the tensor-parallel hooks skip their collectives (single-rank construction probes,
    runner/tensor_parallel/sharding.local_only), and tp_foreign, the token ids of other ranks'
    vocabulary rows, from the embedding's pre-hook to its hook.
`entered` copies the current context with the given fields changed, so a nested entry (a probe
inside a local_only construction) sees the outer fields too; leaving restores the outer object,
also on an error, so nothing of a step outlives its forward. Per thread: two engines stepping
one model in two threads (under the model's lock, runner/attention.model_lock) or a probe in
another thread never read each other's step.

`ForwardSwap` is the one way a `with` block puts forwards of the runner's on modules and takes
them off again (the stateful layers' wrappers, per-call layer indices).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Optional

import torch

_LOCAL = threading.local()


@dataclasses.dataclass
class ForwardContext:
    attn: Any = None                              # runner.step_inputs.AttentionMetadata
    state: Any = None                             # runner.state_cache.StateStep
    recording: Any = None                         # runner.probe.Recording
    tp_local: bool = False
    tp_foreign: Optional[torch.Tensor] = None     # bool, the ids' shape


def current() -> ForwardContext:
    """This thread's context (an empty one outside every `entered`)."""
    ctx = getattr(_LOCAL, "ctx", None)
    if ctx is None:
        ctx = _LOCAL.ctx = ForwardContext()
    return ctx


@contextlib.contextmanager
def entered(**fields):
    """Inside it `current()` is the current context with `fields` replaced."""
    outer = current()
    _LOCAL.ctx = dataclasses.replace(outer, **fields)
    try:
        yield _LOCAL.ctx
    finally:
        _LOCAL.ctx = outer


class ForwardSwap:
    """Base of the context managers that put forwards of their own on some modules for a `with`
    block (state_switch.StateSwitch, attention.PerCallLayerIdx): `forwards()` gives the (module,
    forward) pairs; leaving puts back what each instance had (its own `forward` attribute, or
    none, so the class's runs again). Not reentrant."""

    _saved: list = []

    def forwards(self):
        raise NotImplementedError

    def __enter__(self):
        self._saved = []
        for module, forward in self.forwards():
            self._saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for module, forward in self._saved:
            if forward is _MISSING:
                del module.forward
            else:
                module.forward = forward
        self._saved = []


_MISSING = object()
