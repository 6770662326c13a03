"""Overlapped steps: the host schedules and packs step N+1 while the device runs step N.

A synchronous step is schedule -> run (launch, wait for the sampled tokens) -> postprocess, so on
a GPU the device idles while Python schedules and packs the next batch. With overlap on, the
Engine hands each step() to its OverlapPipeline, which does

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

from typing import Optional

import torch

from cb_kernels.engine.scheduler import ScheduledBatch
from cb_kernels.engine.sequence import PLACEHOLDER, SequenceStatus
from cb_kernels.engine.step import LaunchedStep


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


class OverlapPipeline:
    """The overlapped step of one Engine (used only with overlap on): the step in flight and its
    counters. overlapped_steps: launched before the previous step's tokens were read;
    placeholder_fills: input ids filled on the device; discarded_tokens: sampled for a request
    that had ended meanwhile (cancelled, or stopped in the step before)."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: Optional[LaunchedStep] = None
        self.scheduled: Optional[ScheduledBatch] = None    # the batch of the step() running
        self.overlapped_steps = 0
        self.placeholder_fills = 0
        self.discarded_tokens = 0

    def step(self) -> None:
        """advance(N) -> schedule N+1 -> run N+1 -> resolve(N); N+1 stays in flight. An
        exception that escapes (KeyboardInterrupt while waiting for N's tokens, say) fails the
        requests of N and N+1 as a failed step does, then propagates: no placeholder, pending
        hash or step in flight is left behind."""
        prev, self.in_flight, self.scheduled = self.in_flight, None, None
        try:
            self._step(prev)
        except BaseException as exc:
            self.in_flight = None
            seqs = (prev.batch.seqs if prev is not None else []) + \
                (self.scheduled.seqs if self.scheduled is not None else [])
            if self.scheduled is not None:
                self.engine.end_failed(self.scheduled)
            if seqs:
                self.engine.fail_step(ScheduledBatch(seqs=seqs), exc)
            raise

    def _step(self, prev: Optional[LaunchedStep]) -> None:
        e = self.engine
        retired = self._advance(prev, retire=True) if prev is not None else set()
        batch = self.scheduled = e.scheduler.schedule()
        launched = error = None
        if batch.seqs:
            self.overlapped_steps += prev is not None
            try:
                launched = e.run(batch, prev)
            except Exception as exc:  # one bad step fails its requests, never the engine
                error = exc
        if prev is not None:
            self._resolve(prev, retired, batch.failed)
        e.end_failed(batch)
        if error is not None:
            e.fail_step(batch, error)
        elif launched is not None:
            self._commit_late(launched)
            e.block_manager.end_step()
            if not any(e.is_live(seq) for seq in batch.seqs):
                self.discarded_tokens += len(launched.sampled)   # all stopped in `prev`
            elif launched.pending:
                self.in_flight = launched
            else:
                self._resolve(launched, self._advance(launched, retire=False), [])
        elif prev is None:
            e.check_progress()

    def fill(self, batch: ScheduledBatch, prev: Optional[LaunchedStep], input_ids) -> list:
        """Fill `batch`'s placeholder input ids from `prev`'s tokens on the device; returns the
        late prefix-cache commits (placeholder_rows)."""
        dst, src, late_commits = placeholder_rows(batch, prev, self.engine.runner.block_size)
        if dst:
            fill_placeholders(input_ids, dst, src, prev.device_tokens,
                              self.engine.streams.to_device)
            self.placeholder_fills += len(dst)
        return late_commits

    def _advance(self, launched: LaunchedStep, retire: bool) -> set:
        """The bookkeeping of `launched` that needs no token: computed counts grow and each
        sampling sequence gets a PLACEHOLDER last token. With `retire`, a sequence that surely
        ends in that step (max_new_tokens) gives its blocks back now, so the next schedule does
        not spend a row on it. Returns the seq ids retired."""
        e = self.engine
        retired = set()
        for seq, n in e.advance(launched.batch):
            tokens = seq.token_ids
            if seq.num_computed_tokens == len(tokens):
                tokens.append(PLACEHOLDER)
                if retire and len(tokens) - seq.num_prompt_tokens >= seq.params.max_new_tokens:
                    e.scheduler.finish(seq)
                    retired.add(seq.seq_id)
        return retired

    def _resolve(self, launched: LaunchedStep, retired: set, failed: list) -> None:
        """Read `launched`'s tokens (waiting for them if needed), write them over the
        placeholders and end the requests that stop. `failed`: the requests a failed swap ended
        in the schedule since (their error output is next, unless a token here stopped them)."""
        e = self.engine
        tokens = e.wait_tokens(launched)
        for seq, token in zip(launched.sampled, tokens):
            if not e.is_live(seq):
                self.discarded_tokens += 1    # cancelled, or stopped in the step before
                continue
            assert seq.token_ids[-1] == PLACEHOLDER, f"{seq} lost its placeholder"
            seq.token_ids[-1] = token
            reason = e.accept_token(seq, token)
            if seq.status is SequenceStatus.FINISHED and seq.seq_id not in retired:
                # A failed swap ended it; its error output comes next, unless this token had
                # ended it first (as the synchronous path sees it: it never swapped then).
                if reason is not None:
                    failed.remove(seq)
                    e.end(seq, reason)
                continue
            assert reason is not None or seq.seq_id not in retired, f"{seq} retired early"
            if reason is not None:
                e.end(seq, reason)

    def _commit_late(self, launched: LaunchedStep) -> None:
        """Prefix-cache hashes of the blocks that held a placeholder when `launched` was
        scheduled (BlockManager.commit skipped them); their tokens are known now."""
        e = self.engine
        for seq, n in launched.late_commits:
            if e.is_live(seq) and seq.status is SequenceStatus.RUNNING:
                e.block_manager.commit(seq, seq.num_computed_tokens + n)

    def check_invariants(self) -> None:
        if self.in_flight is not None:
            assert self.in_flight.pending, "a step in flight with no tokens to wait for"
            for seq in self.in_flight.batch.seqs:
                assert not self.engine.is_live(seq) or seq.status is SequenceStatus.RUNNING, \
                    f"{seq} in flight but not running"

    def stats(self) -> dict:
        return {"overlapped_steps": self.overlapped_steps,
                "placeholder_fills": self.placeholder_fills,
                "discarded_tokens": self.discarded_tokens}
