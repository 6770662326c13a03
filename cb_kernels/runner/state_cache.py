"""The slots of stateful layers beside the paged KV cache, and a step's split by sequence.

The pool (`StatePool`): per layer, state kind and state index one tensor [num_slots, *shape]
(shapes from runner/state_layers.probe_specs); a running sequence owns one slot (the same index
in every tensor). The engine's StateSlots (engine/state_slots.py) hands slots out and moves them
(swap, fork copy) through `tensors`.

A step (`plan`): transformers' forward runs on one packed row of every scheduled sequence's new
tokens; runner/state_switch.py runs each stateful module once per group of that row:
  * all decoding sequences (one new token after earlier ones) together, as a [B, 1, H] batch;
  * each prefill or prefill chunk alone, as [1, n, H]: from zero state when it starts at token 0
    (the layer's prefill path), else from its slot (a later chunk: the cache-continuation path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


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
