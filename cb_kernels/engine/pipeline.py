"""Overlapped steps: the host schedules and packs step N+1 while the device runs step N.

A synchronous step is schedule -> launch -> wait for the sampled tokens -> postprocess, so on a
GPU the device idles while Python schedules and packs the next batch. With overlap on, one
Engine.step() call does

    advance(N)     step N's bookkeeping before its tokens are known: num_computed_tokens grows and
                   each sequence that samples in N gets PLACEHOLDER as its last token; one that
                   surely ends in N (it reaches max_new_tokens) is retired: its blocks return now
    schedule N+1   the scheduler sees the state a synchronous step would leave
    launch N+1     inputs packed on the host; the placeholder input ids are then filled on the
                   device from step N's sampled-token tensor (`fill_placeholders`, no host sync)
    resolve(N)     wait for N's tokens, write them over the placeholders, stop checks

and returns with N+1 in flight. Between step() calls no sequence holds a placeholder, so
outputs, stream() deltas and cancel() see only known tokens. A request that stops at N (stop
token) was already scheduled in N+1: that row's token is discarded and its blocks return at
resolve(N); device work stays ordered because every later use of a block runs on the compute
stream, or on a copy stream that waits for compute (streams.py).

A placeholder may sit in any row of N+1: a decode, or the last token of a request re-admitted
for recompute or swapped in inside the same schedule; `placeholder_rows` finds them all.
Prefix-cache hashes of a block holding a placeholder are committed after resolve(N)
(BlockManager.commit skips that block until then).

So on CUDA the host's schedule + input packing of N+1 runs while the device computes N, and the
postprocess of N (token appends, stop checks, outputs) while it computes N+1; the host blocks
only in resolve(N), normally after N+1 was queued. What does not overlap:
  - a step with non-greedy rows: the Sampler draws on the host from the logits (a sync inside
    the launch), so its tokens are known at launch, it resolves at once and the next step is
    scheduled after it (seeded requests keep their tokens: one draw per token, as without overlap);
  - a step that samples nothing (prefill chunks only): nothing to wait for, it resolves at once
    (the device still runs it while the next one is scheduled);
  - the first step after the engine was idle, and the step after a failed one;
  - the swap-in/out copies and copy-on-write copies that a schedule issues: on their own streams
    behind the compute already queued (streams.py), not new overlap here;
  - on a CPU nothing: the forward runs inside the launch. overlap="on" there runs this pipeline
    synchronously, which is how the CPU tests prove its outputs equal the synchronous path's.
A request that stops on a stop token costs one discarded row in the step after (Engine.stats()
"discarded_tokens"); one that ends by max_new_tokens is retired first and costs none.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.engine.scheduler import ScheduledBatch
from cb_kernels.engine.sequence import PLACEHOLDER


@dataclass
class LaunchedStep:
    """A step issued to the device.

    sampled[i] gets row i of the step's tokens: `tokens` is a PendingTokens (greedy rows, on their
    way to the host) or a list of ints (the Sampler ran on the host); device_tokens is int64
    [len(sampled)] on the device (greedy only), what the next step's placeholders are filled from.
    """

    batch: ScheduledBatch
    sampled: list
    tokens: object
    device_tokens: Optional[torch.Tensor]
    start: float                 # perf_counter at launch
    launch_s: float              # host seconds the launch took (the whole step on a CPU)
    late_commits: list           # (seq, num_new_tokens): blocks to hash once tokens are known

    @property
    def pending(self) -> bool:
        return self.device_tokens is not None and not isinstance(self.tokens, list)


def placeholder_rows(batch: ScheduledBatch, prev: Optional[LaunchedStep], block_size: int):
    """Where `batch` feeds a placeholder: (dst, src, fills) with dst the indices into its packed
    input_ids [num_tokens], src the rows of prev.device_tokens that hold those tokens, and fills
    the (seq, num_new_tokens) of the rows among them that fill a block, whose hash waits for the
    token (BlockManager.commit). Call before the batch is advanced (num_computed_tokens as
    scheduled)."""
    dst, src, fills, row_of, end = [], [], [], None, 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        end += n
        tokens = seq.token_ids
        if tokens[-1] == PLACEHOLDER and seq.num_computed_tokens + n == len(tokens):
            if row_of is None:
                assert prev is not None and prev.device_tokens is not None, \
                    f"{seq} holds a placeholder but no step is in flight"
                row_of = {s.seq_id: i for i, s in enumerate(prev.sampled)}
            dst.append(end - 1)
            src.append(row_of[seq.seq_id])
            if len(tokens) % block_size == 0:
                fills.append((seq, n))
    return dst, src, fills


def _is_range(idx: list) -> bool:
    return idx == list(range(idx[0], idx[0] + len(idx)))


def fill_placeholders(input_ids: torch.Tensor, dst: list, src: list, prev_tokens: torch.Tensor,
                      to_device) -> None:
    """input_ids[dst] = prev_tokens[src] on the device, in stream order (no host sync).

    input_ids: int64 [num_tokens]; prev_tokens: int64 [num_prev_sampled], both on one device;
    to_device moves a host index tensor there (StreamOrchestrator.to_device). In steady decoding
    both index lists are ranges (the running requests keep their order), which needs no upload.
    """
    if not dst:
        return
    if _is_range(dst) and _is_range(src):
        k = len(dst)
        input_ids[dst[0]:dst[0] + k].copy_(prev_tokens[src[0]:src[0] + k])
        return
    idx = to_device(torch.tensor([dst, src], dtype=torch.int64))
    input_ids.index_copy_(0, idx[0], prev_tokens.index_select(0, idx[1]))


class StepClock:
    """Where the time of steps goes.

    host_wait_s: seconds the host blocked on sampled tokens (PendingTokens.result).
    launch_s: host seconds spent issuing steps (packing, launches; on a CPU the whole forward).
    With `device_events` on (CUDA only; the bench turns it on, a step then records two timing
    events on the compute stream, ~10 us): device_busy_s, from each step's first input copy to its
    sampled tokens, and device_idle_s, the gaps between one step's end and the next one's start
    while requests were running (a pause with no request in the engine does not count).
    """

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self.device_events = False
        self.host_wait_s = 0.0
        self.launch_s = 0.0
        self.device_busy_s = 0.0
        self.device_idle_s = 0.0
        self.timed_steps = 0
        self._last_end = None
        self._unread: deque = deque()    # (previous end or None, start, end) events

    def start(self):
        if not (self.on_cuda and self.device_events):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, start) -> None:
        if start is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._unread.append((self._last_end, start, event))
        self._last_end = event

    def wait(self, tokens) -> list:
        t0 = time.perf_counter()
        out = tokens.result()
        self.host_wait_s += time.perf_counter() - t0
        return out

    def idle(self) -> None:
        """No request is left: the next step's gap is not device idle time of this workload."""
        self._last_end = None

    def stats(self) -> dict:
        while self._unread and self._unread[0][2].query():
            prev_end, start, end = self._unread.popleft()
            self.device_busy_s += start.elapsed_time(end) / 1e3
            if prev_end is not None:
                self.device_idle_s += prev_end.elapsed_time(start) / 1e3
            self.timed_steps += 1
        return {"host_wait_s": self.host_wait_s, "launch_s": self.launch_s,
                "device_busy_s": self.device_busy_s,
                "device_idle_s": self.device_idle_s, "timed_steps": self.timed_steps}
