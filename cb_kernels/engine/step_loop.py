"""The step loop: `schedule -> launch -> resolve` over the request table, one loop for both modes.

    schedule   the Scheduler picks the batch (engine/scheduler.py)
    launch     the runner packs and runs it (runner/base.py); greedy tokens start their copy to the
               host, sampled rows are drawn by the Sampler
    resolve    wait for the tokens, append them, stop checks, outputs

Overlap decides only when `resolve` runs. Off: right after the launch. On: after the next
launch, so the host schedules and packs step N+1 while the device runs step N:

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
  - on a CPU nothing: the forward runs inside the launch. overlap="on" there runs this loop
    synchronously, which is how the CPU tests prove its outputs equal those of overlap off.
A request that stops on a stop token costs one discarded row in the step after (Engine.stats()
"discarded_tokens"); one that ends by max_new_tokens is retired first and costs none.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from cb_kernels.engine import placeholders
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.scheduler import ScheduledBatch, Scheduler
from cb_kernels.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from cb_kernels.engine.step import LaunchedStep, StepClock
from cb_kernels.engine.streams import StreamOrchestrator
from cb_kernels.engine.table import RequestTable

logger = logging.getLogger("cb_kernels.engine")


class StepLoop:
    """The steps of one Engine over its RequestTable. Counters (stats()): steps, failed_steps,
    generated_tokens, greedy_head_steps (tokens from the greedy head); overlapped_steps (launched
    before the previous step's tokens were read), placeholder_fills (input ids filled on the
    device), discarded_tokens (sampled for a request that had ended meanwhile: cancelled, or
    stopped in the step before); and StepClock's."""

    def __init__(self, table: RequestTable, scheduler: Scheduler, runner, sampler: Sampler,
                 streams: StreamOrchestrator, swapper, overlap: bool, tokenizer=None):
        self.table, self.scheduler, self.runner, self.sampler = table, scheduler, runner, sampler
        self.streams, self.swapper, self.overlap, self.tokenizer = streams, swapper, overlap, \
            tokenizer
        self.block_manager = scheduler.block_manager
        self.clock = StepClock(runner.device.type == "cuda")
        self.in_flight: Optional[LaunchedStep] = None
        self.scheduled: Optional[ScheduledBatch] = None    # the batch of the step() running
        self.num_steps = self.num_failed_steps = 0
        self.num_generated_tokens = self.num_greedy_head_steps = 0
        self.overlapped_steps = self.placeholder_fills = self.discarded_tokens = 0

    def step(self) -> None:
        """[advance(N)] -> schedule N+1 -> launch N+1 -> [resolve(N)] -> resolve(N+1) unless it
        stays in flight (overlap on, tokens pending). An exception that escapes (KeyboardInterrupt
        while waiting for tokens, say) fails the requests of N and N+1 as a failed step does, then
        propagates: no placeholder, pending hash or step in flight is left behind."""
        prev, self.in_flight, self.scheduled = self.in_flight, None, None
        try:
            self._step(prev)
        except BaseException as exc:
            self.in_flight = None
            seqs = (prev.batch.seqs if prev is not None else []) + \
                (self.scheduled.seqs if self.scheduled is not None else [])
            if self.scheduled is not None:
                self.end_failed(self.scheduled)
            if seqs:
                self.fail_step(seqs, exc)
            raise
        if not self.table.num_live:
            self.clock.idle()

    def settle(self) -> None:
        """Resolve the step in flight (overlap on) and launch none: every token computed so far
        is then in its sequence (Engine.pause, sleep)."""
        prev, self.in_flight = self.in_flight, None
        if prev is None:
            return
        try:
            self.resolve(prev, self._advance(prev, retire=True), [])
        except BaseException as exc:
            self.fail_step(prev.batch.seqs, exc)
            if not isinstance(exc, Exception):
                raise

    def _step(self, prev: Optional[LaunchedStep]) -> None:
        retired = self._advance(prev, retire=True) if prev is not None else set()
        batch = self.scheduled = self.scheduler.schedule()
        launched = error = None
        if batch.seqs:
            self.overlapped_steps += prev is not None
            try:
                launched = self.launch(batch, prev)
            except Exception as exc:  # one bad step fails its requests, never the engine
                error = exc
        if prev is not None:
            self.resolve(prev, retired, batch.failed)
        self.end_failed(batch)
        if error is not None:
            self.fail_step(batch.seqs, error)
        elif launched is not None:
            self._commit_late(launched)
            self.block_manager.end_step()
            if not any(self.table.is_live(seq) for seq in batch.seqs):
                self.discarded_tokens += len(launched.sampled)   # all stopped in `prev`
            elif self.overlap and launched.pending:
                self.in_flight = launched
            else:
                try:
                    self.resolve(launched, self._advance(launched, retire=False), [])
                except Exception as exc:  # noqa: BLE001 (a stop check or tokenizer failed)
                    self.fail_step(batch.seqs, exc)
        elif prev is None:
            self.check_progress()

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, batch: ScheduledBatch, prev: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Issue `batch` to the runner; placeholders are filled from `prev`'s tokens on the
        device. Greedy tokens travel to the host behind an event."""
        self.num_steps += 1
        r, start = self.runner, time.perf_counter()
        self.streams.begin_compute()
        r.copy_blocks(batch.blocks_to_copy)
        inputs = r.prepare(batch.seqs, batch.num_new_tokens)
        late_commits = self._fill(batch, prev, inputs.input_ids)
        sampled, event, prompt_rows = inputs.sampled, self.clock.start(), None
        if batch.prompt_logprobs:     # requests that asked for prompt logprobs prefill here
            inputs.logits_indices, prompt_rows = self.sampler.prompt_rows(batch,
                                                                          inputs.logits_indices)
        greedy = bool(sampled) and not prompt_rows and all(seq.params.greedy for seq in sampled)
        out = r.execute(inputs, greedy)
        device_tokens = None
        if greedy:
            self.num_greedy_head_steps += out.greedy_head
            device_tokens = out.tokens
            self.clock.end(event)
            tokens = self.streams.tokens_to_host(device_tokens)
        else:
            tokens = self.sampler(out.logits, sampled, prompt_rows) if sampled or prompt_rows \
                else []
            self.clock.end(event)
        launch_s = time.perf_counter() - start
        self.clock.launch_s += launch_s
        return LaunchedStep(batch, sampled, tokens, device_tokens, start, launch_s, late_commits)

    def _fill(self, batch: ScheduledBatch, prev: Optional[LaunchedStep], input_ids) -> list:
        """Fill `batch`'s placeholder input ids from `prev`'s tokens on the device; returns the
        late prefix-cache commits (placeholders.placeholder_rows)."""
        if prev is None:
            return []
        dst, src, late_commits = placeholders.placeholder_rows(batch, prev,
                                                               self.block_manager.block_size)
        if dst:
            placeholders.fill_placeholders(input_ids, dst, src, prev.device_tokens,
                                           self.streams.to_device)
            self.placeholder_fills += len(dst)
        return late_commits

    # -- resolve ----------------------------------------------------------------------------------
    def _advance(self, launched: LaunchedStep, retire: bool) -> set:
        """The bookkeeping of `launched` that needs no token: computed counts grow and each
        sampling sequence gets a PLACEHOLDER last token. With `retire`, a sequence that surely
        ends in that step (max_new_tokens) gives its blocks back now, so the next schedule does
        not spend a row on it. Returns the seq ids retired."""
        now, retired = time.perf_counter(), set()
        for seq, n in zip(launched.batch.seqs, launched.batch.num_new_tokens):
            if not self.table.is_live(seq):          # cancelled while in flight
                continue
            seq.num_computed_tokens += n
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            tokens = seq.token_ids
            if seq.num_computed_tokens == len(tokens):
                tokens.append(PLACEHOLDER)
                if retire and len(tokens) - seq.num_prompt_tokens >= seq.params.max_new_tokens:
                    self.scheduler.finish(seq)
                    retired.add(seq.seq_id)
        return retired

    def resolve(self, launched: LaunchedStep, retired: set, failed: list) -> None:
        """Read `launched`'s tokens (waiting for them if needed), write them over the
        placeholders and end the requests that stop. `failed`: the requests a failed swap ended
        in the schedule since (their error output is next, unless a token here stopped them)."""
        for seq, token in zip(launched.sampled, self._wait_tokens(launched)):
            if not self.table.is_live(seq):
                self.discarded_tokens += 1    # cancelled, or stopped in the step before
                continue
            assert seq.token_ids[-1] == PLACEHOLDER, f"{seq} lost its placeholder"
            seq.token_ids[-1] = token
            reason = self._accept_token(seq, token)
            if seq.status is SequenceStatus.FINISHED and seq.seq_id not in retired:
                # A failed swap ended it; its error output comes next, unless this token had
                # ended it first (as overlap off sees it: it never swapped then).
                if reason is not None:
                    failed.remove(seq)
                    self.end(seq, reason)
                continue
            assert reason is not None or seq.seq_id not in retired, f"{seq} retired early"
            if reason is not None:       # seq.error: set by a structured output's failure
                self.end(seq, reason, seq.error)

    def _wait_tokens(self, launched: LaunchedStep) -> list:
        """`launched`'s sampled tokens on the host (waiting for them if needed)."""
        tokens = launched.tokens
        if not isinstance(tokens, list):
            tokens = self.clock.wait(tokens)
        if self.swapper is not None and launched.batch.num_prefill_tokens:
            # The swap-or-recompute choice weighs copies against this measured rate: the launch
            # time where the device is synchronous; else until the tokens are read (an upper
            # bound when a later step was launched in between).
            seconds = (time.perf_counter() - launched.start if self.streams.asynchronous
                       else launched.launch_s)
            self.swapper.policy.record_prefill(launched.batch.num_tokens, seconds)
        return tokens

    def _accept_token(self, seq: Sequence, token: int) -> Optional[str]:
        """Record `token` (already the last of seq.token_ids); returns the stop reason or None."""
        now, m = time.perf_counter(), seq.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        self.num_generated_tokens += 1
        if seq.group is not None and seq.group.pending:
            self._fork(seq)
        return seq.check_stop(token, self.tokenizer)

    def _fork(self, root: Sequence) -> None:
        """The other samples of `root`'s request (n > 1), drawn with its first token, start from
        its prompt KV: shared blocks, copy-on-write of the partial last one (scheduler.fork)."""
        children = root.group.take_pending()
        self.table.add_forked(root, children)
        self.scheduler.fork(root, children)
        for child in children:
            reason = self._accept_token(child, child.token_ids[-1])
            if reason is not None:
                self.end(child, reason, child.error)

    def _commit_late(self, launched: LaunchedStep) -> None:
        """Prefix-cache hashes of the blocks that held a placeholder when `launched` was
        scheduled (BlockManager.commit skipped them); their tokens are known now."""
        for seq, n in launched.late_commits:
            if self.table.is_live(seq) and seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit(seq, seq.num_computed_tokens + n)

    # -- ending requests --------------------------------------------------------------------------
    def end(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        """End one live sequence: its blocks return, its request's output is queued."""
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        if seq.has_placeholder:      # ended inside an overlapped step (interrupted)
            seq.token_ids.pop()
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finished_time = time.perf_counter()
        self.table.remove(seq)

    def end_failed(self, batch: ScheduledBatch) -> None:
        for seq in batch.failed:      # a swap failed: that request alone ends
            self.end(seq, "error", seq.error)
        batch.failed.clear()

    def fail_step(self, seqs: list, error: BaseException) -> None:
        self.num_failed_steps += 1
        message = f"{type(error).__name__}: {error}"
        logger.error("step %d failed; failing its %d requests: %s", self.num_steps,
                     len(seqs), message)
        self.block_manager.discard_step_hashes()
        for seq in seqs:
            if self.table.is_live(seq):
                self.end(seq, "error", message)

    def check_progress(self) -> None:
        s = self.scheduler
        if s.has_unfinished():
            # Cannot happen while add_request rejects requests that never fit (scheduler.py);
            # raising beats spinning forever in generate() if that proof ever breaks.
            raise RuntimeError(
                f"the scheduler found nothing to run: running={len(s.running)} waiting="
                f"{len(s.waiting)} swapped={len(s.swapped)} free_blocks="
                f"{len(self.block_manager.free_ids)} of {self.block_manager.num_blocks}")

    # -- introspection ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for seq in self.table.live():
            assert not seq.has_placeholder, f"{seq} keeps a placeholder between steps"
        if self.in_flight is not None:
            assert self.overlap and self.in_flight.pending, \
                "a step in flight with no tokens to wait for"
            for seq in self.in_flight.batch.seqs:
                assert not self.table.is_live(seq) or seq.status is SequenceStatus.RUNNING, \
                    f"{seq} in flight but not running"

    def stats(self) -> dict:
        return {"steps": self.num_steps, "failed_steps": self.num_failed_steps,
                "generated_tokens": self.num_generated_tokens,
                "overlapped_steps": self.overlapped_steps,
                "placeholder_fills": self.placeholder_fills,
                "discarded_tokens": self.discarded_tokens,
                "greedy_head_steps": self.num_greedy_head_steps, **self.clock.stats()}
