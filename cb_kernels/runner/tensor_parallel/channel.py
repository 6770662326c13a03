"""The step channel of a tensor-parallel runner: rank 0's messages to the other ranks, and the
wire format of a packed step.

A message is one small int64 header broadcast on the control group (kind, payload size, sizes;
on CPU it also carries the first `_INLINE` payload ints) and, when the payload does not fit
there, the rest of it on the model's group (a device tensor on CUDA). Three kinds:
  STEP  the packed step (runner/step_inputs.StepInputs: input ids after the overlap loop filled
        them, positions, logits rows, slot mapping, block tables, lengths, the chunked view) and
        the step's copy-on-write block pairs, and rank 0's weight_version; a follower rebuilds the
        StepInputs around its own KV shard (its LayerLayout) and runs the same forward;
  CONTROL one of the engine's RL calls (sleep, wake_up, update_weights, ...): pickled (op, args)
        that every rank runs on its own shard; update_weights' tensors follow it, one broadcast
        each (`broadcast_tensor`, as bytes on the control group);
  DONE  the end of a session: pickled (outputs, error) that the followers' serve() returns.

Failure: any error inside a collective (a rank died: the connection drops; a rank hangs: the
collective times out after the timeout) leaves the ranks out of step, so the channel is marked
broken: every later message raises TensorParallelError at once, naming the rank and the cause.
"""
from __future__ import annotations

import logging
import pickle
from typing import Optional

import torch

from cb_kernels.runner.step_inputs import AttentionMetadata, ChunkedView, LayerLayout, StepInputs

logger = logging.getLogger("cb_kernels.engine")

STEP, DONE, CONTROL = 1, 2, 3
_HEADER = 16
# On CPU a step's first _INLINE payload ints travel in the header's broadcast: a decode step of
# 16 sequences is one broadcast, not two (each ~80 us on gloo over loopback, 2-core bench host).
_INLINE = 1024


class TensorParallelError(RuntimeError):
    """The ranks of a tensor-parallel engine fell out of step (one died, hung or failed)."""


class StepChannel:
    """Rank 0 -> the other ranks. `group`: the model's collectives (gloo or NCCL); `control`: the
    headers (gloo; the same group on CPU)."""

    def __init__(self, rank: int, size: int, group, control, device: torch.device,
                 timeout_s: float):
        self.rank, self.size, self.group, self.control = rank, size, group, control
        self.device, self.timeout_s = device, timeout_s
        self.broken: Optional[str] = None

    def collective(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), a torch.distributed call; a failure breaks the channel."""
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        try:
            return fn(*args, **kwargs)
        except Exception as e:            # noqa: BLE001 (gloo/NCCL errors: DistBackendError, ...)
            self.fail(e)

    def fail(self, error: BaseException):
        """Mark the channel broken by `error` and raise TensorParallelError."""
        if isinstance(error, TensorParallelError):
            raise error
        self.broken = (f"tensor parallelism: rank {self.rank} of {self.size} lost step with the "
                       f"other ranks (one died, hung past the {self.timeout_s:g} s "
                       f"tensor_parallel_timeout_s, or failed): {type(error).__name__}: {error}")
        logger.error("%s", self.broken)
        raise TensorParallelError(self.broken) from error

    def _inline(self) -> int:
        """Payload ints carried by the header's broadcast (CPU: one group for both)."""
        return _INLINE if self.group is self.control else 0

    # -- rank 0 ---------------------------------------------------------------------------------
    def _send(self, kind: int, sizes: list, payload: torch.Tensor, group) -> None:
        inline = self._inline() if kind == STEP else 0
        k = min(payload.numel(), inline)
        header = torch.zeros(_HEADER + inline, dtype=torch.int64)
        header[0], header[1] = kind, payload.numel()
        header[2:2 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        if k:
            header[_HEADER:_HEADER + k] = payload[:k]
        self.collective(torch.distributed.broadcast, header, 0, group=self.control)
        if payload.numel() > k:
            self.collective(torch.distributed.broadcast, payload[k:].contiguous(), 0,
                            group=group)

    def send_step(self, inputs: StepInputs, copies: list, greedy: bool,
                  weight_version: int = 0) -> None:
        a = inputs.attn
        parts = [inputs.input_ids, inputs.positions, inputs.logits_indices, a.slot_mapping,
                 a.block_tables.reshape(-1).long(), a.seq_lens.long(), a.cu_seqlens_q.long()]
        chunk = [0, 0]
        if a.chunked is not None:
            c = a.chunked
            chunk = [c.block_tables.shape[0], c.block_tables.shape[1]]
            parts += [c.block_tables.reshape(-1).long(), c.seq_lens.long(), c.cu_seqlens_q.long()]
        flat = [x for pair in copies for x in pair]
        dev = inputs.input_ids.device
        parts.append(torch.tensor(flat, dtype=torch.int64).to(dev))
        payload = torch.cat([p.to(torch.int64) for p in parts])
        sizes = [inputs.input_ids.numel(), inputs.logits_indices.numel(), inputs.num_seqs,
                 a.block_tables.shape[1], len(inputs.sampled), int(greedy), len(copies)] + chunk
        self._send(STEP, sizes + [weight_version], payload, self.group)

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        """End the session; the other ranks' receive() gives `outputs` (or raises
        TensorParallelError(error)). Nothing is sent on a broken channel."""
        if self.broken is not None:
            return
        self._send_pickled(DONE, (outputs, error))

    def send_control(self, op: str, args: dict) -> None:
        """One RL call for every rank to run: the other ranks' receive() gives (CONTROL,
        (op, args))."""
        self._send_pickled(CONTROL, (op, args))

    def _send_pickled(self, kind: int, obj) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._send(kind, [], payload, self.control)

    def broadcast_tensor(self, tensor: Optional[torch.Tensor], dtype: torch.dtype,
                         shape: tuple) -> torch.Tensor:
        """Rank 0's `tensor` (any device) on every rank, as a CPU tensor of `dtype` and `shape`
        (the other ranks pass None). Sent as its bytes on the gloo control group, so every dtype
        travels (gloo lacks some, e.g. bool and float8)."""
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        if self.rank == 0:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        else:
            data = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.collective(torch.distributed.broadcast, data, 0, group=self.control)
        return data.view(dtype).view(shape)

    # -- the other ranks ------------------------------------------------------------------------
    def receive(self, layout: LayerLayout):
        """The next message: (STEP, (inputs, greedy, copies, weight_version)) with the step's
        inputs over this rank's `layout`, (CONTROL, (op, args)), or (DONE, outputs)."""
        inline = self._inline()
        header = torch.zeros(_HEADER + inline, dtype=torch.int64)
        self.collective(torch.distributed.broadcast, header, 0, group=self.control)
        kind, n = int(header[0]), int(header[1])
        if kind in (DONE, CONTROL):
            payload = torch.empty(n, dtype=torch.uint8)
            self.collective(torch.distributed.broadcast, payload, 0, group=self.control)
            message = pickle.loads(payload.numpy().tobytes())
            if kind == CONTROL:
                return CONTROL, message
            outputs, error = message
            if error is not None:
                raise TensorParallelError(f"rank 0 failed: {error}")
            return DONE, outputs
        if kind != STEP:
            self.fail(RuntimeError(f"unknown message kind {kind} from rank 0"))
        k = min(n, inline)
        payload = header[_HEADER:_HEADER + k]
        if n > k:
            rest = torch.empty(n - k, dtype=torch.int64, device=self.device)
            self.collective(torch.distributed.broadcast, rest, 0, group=self.group)
            payload = torch.cat([payload.to(self.device), rest]) if k else rest
        return STEP, unpack_step(header[2:_HEADER].tolist(), payload, layout)


def unpack_step(sizes: list, payload: torch.Tensor, layout: LayerLayout):
    """(inputs, greedy, copies, weight_version) of a STEP message (send_step's layout of the
    payload)."""
    num_tokens, num_logits, num_seqs, width, num_sampled, greedy, num_copies, pieces, \
        piece_width, weight_version = sizes[:10]
    lengths = [num_tokens, num_tokens, num_logits, num_tokens, num_seqs * width, num_seqs,
               num_seqs + 1]
    if pieces:
        lengths += [pieces * piece_width, pieces, pieces + 1]
    lengths.append(2 * num_copies)
    parts = list(payload.split(lengths))
    ids, pos, logits_idx, slots, tables, lens, cu = parts[:7]
    chunked = None
    if pieces:
        t, cl, ccu = parts[7:10]
        chunked = ChunkedView(t.int().view(pieces, piece_width), cl.int(), ccu.int())
    flat = parts[-1].tolist() if num_copies else []     # (a device sync on CUDA)
    copies = list(zip(flat[0::2], flat[1::2]))
    attn = AttentionMetadata(
        slot_mapping=slots, block_tables=tables.int().view(num_seqs, width),
        seq_lens=lens.int(), cu_seqlens_q=cu.int(), layout=layout, chunked=chunked)
    return StepInputs(ids, pos, logits_idx, attn, [None] * num_sampled, num_seqs), \
        bool(greedy), copies, weight_version
