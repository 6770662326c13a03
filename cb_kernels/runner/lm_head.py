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


# Logits of at least this many bytes are written into a workspace the head keeps (up to the
# cap; larger ones are allocated per call): a fresh tensor that size is fresh pages from the
# kernel, and a GRPO step's [512, 49152] fp32 logits (100 MB) spent ~40 ms of a 320 ms head in
# page faults (1 thread, Zen 4; 2 threads 20-30 ms), ~5% of a round. Smaller ones come from the
# allocator's free lists anyway.
WORKSPACE_MIN_BYTES = 16 << 20
WORKSPACE_MAX_BYTES = 256 << 20


def _held_elsewhere(t: torch.Tensor) -> bool:
    """Whether a tensor other than `t` (a view handed out earlier, kept by a caller) still holds
    t's storage; True where torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    return use_count(t.untyped_storage()._cdata) > 2      # t, and the storage object asked


class LogitsHead:
    """Full logits of `module` (the model's output embedding): `run(rows [S, hidden]) -> [S,
    vocab]`, returned as fp32. Where `run` takes an `out` (the packed head, `takes_out`), large
    logits go into one workspace, reused only once no tensor from an earlier call is left."""

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], module: torch.nn.Module):
        self.run, self.module = run, module
        self._workspace: Optional[torch.Tensor] = None     # flat, of the weight's dtype

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        out = self._out(rows.shape[0]) if getattr(self.run, "takes_out", False) else None
        return (self.run(rows) if out is None else self.run(rows, out=out)).float()

    def _out(self, num_rows: int) -> Optional[torch.Tensor]:
        """A [num_rows, vocab] view of the workspace, or None (the run allocates its own)."""
        weight = getattr(self.module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        numel = num_rows * weight.shape[0]
        nbytes = numel * weight.element_size()
        if nbytes < WORKSPACE_MIN_BYTES or nbytes > WORKSPACE_MAX_BYTES:
            return None
        ws = self._workspace
        if ws is None or ws.dtype != weight.dtype or ws.numel() < numel or _held_elsewhere(ws):
            # A new one: an old one still held stays with its holder.
            self._workspace = ws = torch.empty(numel, dtype=weight.dtype)
        return ws[:numel].view(num_rows, weight.shape[0])

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
