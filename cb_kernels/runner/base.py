"""The one interface between the Engine and what runs the model: the ModelRunner protocol.

The engine never touches the model; it hands each scheduled batch to its runner. A runner for
another model kind implements these attributes and methods and is passed as
`Engine(model, config, runner=...)`; TransformersRunner is the default one. A runner over one
rank's shard of a model split across processes adds what TensorParallelRunner declares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from cb_kernels.runner.step_inputs import LayerLayout, StepInputs


@dataclass
class StepOutput:
    """What a step gives back for its sampled rows (StepInputs.sampled, in order).

    logits: fp32 [len(logits_indices), vocab_size], a row per StepInputs.logits_indices entry
    (None on an all-greedy step); tokens: int64 [num_sampled] on the model's device, the argmax of
    each row (set exactly when execute ran with greedy=True); greedy_head: the tokens came from a
    greedy head, not from full logits (Engine.stats()["greedy_head_steps"] counts those steps).
    """

    logits: Optional[torch.Tensor]
    tokens: Optional[torch.Tensor]
    greedy_head: bool = False


@runtime_checkable
class ModelRunner(Protocol):
    """Runs one model on a paged KV cache, one packed step at a time. Everything the engine (and
    the tensor-parallel runners) read of a runner is declared here; nothing else is read.

    Model facts, read once (sizing, request checks): num_layers (layers holding KV),
    num_kv_heads (of this rank's cache) and head_dim (the widest layer's: a block never holds
    more than the engine counted), max_positions (the longest sequence the model takes),
    vocab_size, dtype, device, eos_token_ids (frozenset).
    state_bytes_per_seq: bytes of per-sequence state of hybrid / recurrent layers (0: none).

    After allocate_cache: k_caches, v_caches (the KV pool, one [num_blocks, block_size,
    num_kv_heads, head_dim] tensor per KV layer; the swapper moves blocks of them), block_size,
    state_tensors (each [max_num_seqs, ...], one slot per running sequence; the engine hands
    slots out as seq.state_slot, copies them on fork and swaps them with the blocks; [] without
    state), and layout (step_inputs.LayerLayout: the static per-layer view every step's attention
    reads: caches by layer index, sliding windows, softcap, chunked layers, attention backend).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset
    state_bytes_per_seq: int
    k_caches: list
    v_caches: list
    block_size: int
    state_tensors: list
    layout: Optional[LayerLayout]

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       max_num_seqs: int) -> None:
        """Create the KV pool, the state slots and the layout (and whatever else is sized by
        them, e.g. CUDA graph buffers)."""

    def copy_blocks(self, pairs: list) -> None:
        """Copy blocks (src, dst) in every layer (copy-on-write of shared prefix blocks)."""

    def prepare(self, seqs: list, num_new_tokens: list) -> StepInputs:
        """Pack seqs[i]'s next num_new_tokens[i] tokens (from seq.num_computed_tokens, through
        seq.block_table) and upload them; no device work waits on the host after this."""

    def execute(self, inputs: StepInputs, greedy: bool = False) -> StepOutput:
        """Run the step. `greedy` (every sampled row takes the argmax): return the tokens (and no
        logits); else the logits of every logits_indices row."""

    def reserve_workspace(self, num_tokens: int, num_seqs: int) -> int:
        """Engine construction (CPU runners): make the kernels' scratch for a step of up to
        num_tokens rows over num_seqs sequences ready (allocated and written), so the first
        steps fault none of its pages; the bytes held (0: none)."""

    def release_memory(self, kv: bool, weights: bool) -> int:
        """Engine.sleep: free the KV pool and state slots (`kv`; the tensor objects stay, empty)
        and the runner's private weight copies and scratch buffers (`weights`); the bytes freed."""

    def restore_memory(self, kv: bool, weights: bool) -> None:
        """Engine.wake_up: a zeroed pool of the old shapes (`kv`), the weight copies rebuilt from
        the model's weights as they are now (`weights`)."""

    def refresh_weights(self) -> None:
        """Rebuild every copy derived from the weights (packed linears, the greedy head)."""


@runtime_checkable
class TensorParallelRunner(ModelRunner, Protocol):
    """A ModelRunner over one rank's shard of a model split across a torch.distributed process
    group (runner/tensor_parallel/: DriverRunner on rank 0, FollowerRunner on the others; built by
    engine/distributed.build_runner). Passed as `runner=` on every rank: the Engine agrees its
    config over `channel` and, on the ranks other than 0, runs rank 0's steps through `serve`.

    rank (0 drives: its engine schedules and samples) of world_size ranks; channel (the
    StepChannel to the other ranks: `collective(fn, ...)` on its `control` group).
    release_memory / restore_memory / refresh_weights act on this rank's shard alone; the engine
    sends its RL calls to the other ranks (engine/distributed.everywhere): rank 0's runner has
    `send_control(op, args)` and `weight_version` (rank 0's engine's, sent with each step); the
    others' serve() hands each call to `on_control(op, args)` and, before each step, rank 0's
    weight_version to `before_step(version)` (both set by the engine on those ranks).
    """

    rank: int
    world_size: int
    channel: object
    weight_version: int
    on_control: object
    before_step: object

    def send_control(self, op: str, args: dict) -> None:
        """Rank 0: send one of the engine's calls to the other ranks (their serve() runs it)."""

    def serve(self, until: Optional[str] = None):
        """Ranks other than 0: run rank 0's steps (and RL calls) until rank 0 ends the session;
        returns what rank 0 passed to release(). `until`: return the result of rank 0's call of
        that name once it ran here (raise the error rank 0 refused it with)."""

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        """Rank 0: end the session (the others' serve() returns `outputs`, or raises with
        `error`)."""
