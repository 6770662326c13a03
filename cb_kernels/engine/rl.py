"""What the Engine's RL surface needs beside its parts (DESIGN.md, "RL surface"): weights pushed
by name, and a scheduler that admits nothing new while pause(mode="wait") drains it."""
from __future__ import annotations

import contextlib
import difflib
from collections import deque

import torch


def load_named(model: torch.nn.Module, named_tensors) -> int:
    """Copy each (name, tensor) into the model's parameter of that transformers name
    (`named_parameters(remove_duplicate=False)`: both names of a tied weight are known and
    write the one tensor). Every pair is checked (check_named) before any is written, so a bad
    push changes nothing. Values are converted to the parameter's dtype and device. Returns the
    number of tensors written."""
    pairs = check_named(model, named_tensors)
    with torch.no_grad():
        for _, p, tensor in pairs:
            p.copy_(tensor)           # moves the version counter; the engine repacks anyway
    return len(pairs)


def check_named(model: torch.nn.Module, named_tensors, shape_of=None) -> list:
    """[(name, parameter, tensor)] of a push, each checked: a (name, tensor) pair, a known
    name, the shape (`shape_of(name, parameter)`: the parameter's own by default; the unsplit
    one of a tensor-parallel model), a floating tensor for a floating parameter. Raises
    TypeError/ValueError naming the parameter at the first bad pair."""
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    params = dict(model.named_parameters(remove_duplicate=False))
    pairs = []
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"named_tensors must hold (name, tensor) pairs, got {item!r:.80}")
        name, tensor = item
        p = params.get(name)
        if p is None:
            near = difflib.get_close_matches(str(name), params, n=3) or list(params)[:3]
            raise ValueError(f"update_weights: the model has no parameter {name!r} (names as "
                             f"model.named_parameters() gives them; close: {near})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} must be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        want = tuple(p.shape) if shape_of is None else tuple(shape_of(name, p))
        if tuple(tensor.shape) != want:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the "
                             f"model's parameter {want}")
        if not (tensor.is_floating_point() or not p.is_floating_point()):
            raise TypeError(f"update_weights: {name!r} is {tensor.dtype}, the parameter "
                            f"{p.dtype}")
        pairs.append((name, p, tensor))
    return pairs


@contextlib.contextmanager
def admitting_nothing(scheduler):
    """Inside: the requests queued before it stay out of the scheduler's reach (a request
    preempted inside re-queues and is admitted again); after: back at the queue's head."""
    held, scheduler.waiting = scheduler.waiting, deque()
    try:
        yield
    finally:
        scheduler.waiting.extend(held)
