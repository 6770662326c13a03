"""The LM head of a runner, chosen once: full fp32 logits, or the greedy head on top of them.

A step gives the head the final hidden rows of the sequences that sample. `logits(rows)` is
always there; `tokens(rows)` answers all-greedy steps with the argmax token ids, or None to take
the logits (then the engine takes their argmax). `GreedyTokensHead` answers with
`ops.GreedyHead`: every vocab row scored with int8 VNNI dot products and a proven error bound,
the few rows that can still win rescored exactly, so the token is the exact-logit argmax at about
a quarter of the fp32 head's cost (SmolLM2-135M head, 16 rows: 1.5-1.9 ms against 7 ms for the
packed oneDNN head and argmax, 2-core Zen 4). For a bf16 head it gives the argmax of the bf16
logits (ops/greedy_head.py says how), against oneDNN's bf16 head and argmax.

The head runs through the module (`run` calls it, so its hooks and packed forward apply); the
greedy head steps aside (None) whenever it would compute something else than that module: a
hook or an instance forward on it, a bias, a weight replaced by one of another shape or dtype.
The runner rebuilds the head when the model's output embedding is replaced.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from cb_kernels import ops
from cb_kernels.runner.packed_linears import has_hooks

logger = logging.getLogger("cb_kernels")


def _plain_weight(module) -> bool:
    return getattr(module, "bias", None) is None and \
        ops.GreedyHead.accepts(getattr(module, "weight", None))


class LogitsHead:
    """Full logits of `module` (the model's output embedding): `run(rows [S, hidden]) -> [S,
    vocab]`, returned as fp32."""

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module):
        self.run, self.module = run, module

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.run(rows).float()

    def tokens(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        return None


class GreedyTokensHead(LogitsHead):
    """Full logits through `run`, and greedy tokens from an int8 copy of `module`'s weight."""

    def __init__(self, run, module: torch.nn.Module, greedy: "ops.GreedyHead"):
        super().__init__(run, module)
        self.greedy = greedy

    def tokens(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """int64 [S], or None: the fp32 head then decides (a non-finite hidden state, whose
        argmax follows torch's NaN rule, or a head the greedy copy no longer matches)."""
        m, g = self.module, self.greedy
        if has_hooks([m]):
            return None
        if g is None or g.weight is not m.weight or tuple(m.weight.shape) != (g.vocab, g.hidden) \
                or not _plain_weight(m):
            self.greedy = g = _build_greedy(m, announce=False)
            if g is None:
                return None
        try:
            return g(rows)
        except RuntimeError:
            return None


def _build_greedy(module, announce: bool = True) -> Optional["ops.GreedyHead"]:
    if not _plain_weight(module):
        if announce:
            logger.info("greedy_head: off (the LM head has a bias or is not a plain fp32 or bf16 weight)")
        return None
    try:
        greedy = ops.GreedyHead(module.weight)
    except RuntimeError as e:            # a non-finite weight
        logger.warning("greedy_head: off (%s)", e)
        return None
    if announce:
        logger.info("greedy_head: on (%.1f MiB int8 copy of the LM head)",
                    greedy.packed.numel() / 2**20)
    return greedy


def wants_greedy_head(mode) -> bool:
    """EngineConfig.greedy_head: True, False, or "auto" (where the CPU has AVX-512 VNNI)."""
    return mode is True or (mode == "auto" and ops.GreedyHead.fast())


def choose_lm_head(module: torch.nn.Module, run: Callable, mode) -> LogitsHead:
    """The head for a runner whose final hidden rows are exactly what `module` (the model's
    output embedding, computed by `run`) projects to logits."""
    greedy = _build_greedy(module) if wants_greedy_head(mode) else None
    if greedy is not None:
        return GreedyTokensHead(run, module, greedy)
    return LogitsHead(run, module)
