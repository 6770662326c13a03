"""The one interface between the Engine and what runs the model: the ModelRunner protocol.

The engine never touches the model; it hands each scheduled batch to its runner. A runner for
another model kind (tensor parallel, a hybrid model with recurrent state) implements these
attributes and methods and is passed as `Engine(model, config, runner=...)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from cb_kernels.runner.step_inputs import StepInputs


@dataclass
class StepOutput:
    """What a step gives back for its sampled rows (StepInputs.sampled, in order): fp32 logits
    [len(logits_indices), vocab_size] (a row per StepInputs.logits_indices entry), or (all-greedy steps only) int64 token ids [num_sampled] on the
    model's device, with the other field None."""

    logits: Optional[torch.Tensor]
    tokens: Optional[torch.Tensor]


@runtime_checkable
class ModelRunner(Protocol):
    """Runs one model on a paged KV cache, one packed step at a time.

    Model facts, read once (sizing, request checks): num_layers, num_kv_heads (of this rank's
    cache), head_dim, max_positions, vocab_size, dtype, device, eos_token_ids (frozenset).
    After allocate_cache: k_caches, v_caches (per layer [num_blocks, block_size, num_kv_heads,
    head_dim]; the swapper moves blocks of them) and block_size.
    Optional, for models with per-sequence state (hybrid / recurrent layers):
    state_bytes_per_seq (int, 0 or absent: none) and, after allocate_cache, state_tensors (each
    [max_num_seqs, ...], one slot per running sequence; the engine hands slots out as
    seq.state_slot, copies them on fork and swaps them with the blocks).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset
    k_caches: list
    v_caches: list
    block_size: int

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       max_num_seqs: int) -> None:
        """Create the KV pool (and whatever else is sized by it, e.g. CUDA graph buffers)."""

    def copy_blocks(self, pairs: list) -> None:
        """Copy blocks (src, dst) in every layer (copy-on-write of shared prefix blocks)."""

    def prepare(self, seqs: list, num_new_tokens: list) -> StepInputs:
        """Pack seqs[i]'s next num_new_tokens[i] tokens (from seq.num_computed_tokens, through
        seq.block_table) and upload them; no device work waits on the host after this."""

    def execute(self, inputs: StepInputs, greedy: bool = False) -> StepOutput:
        """Run the step. `greedy`: every sampled row takes the argmax, so tokens may come back
        instead of logits."""

    def refresh_weights(self) -> None:
        """Rebuild every copy derived from the weights (packed linears, the greedy head)."""
