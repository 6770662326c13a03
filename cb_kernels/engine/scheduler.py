"""Which tokens of which requests run in the next step.

One token budget per step (max_batch_tokens) is shared by decodes and prefill chunks:
  1. running requests that decode (one token each), oldest first;
  2. running requests whose prefill was cut into chunks, oldest first;
  3. waiting requests in arrival order (preempted ones at the front), while the budget, the
     max_num_seqs limit and the free blocks allow. An admitted request gets blocks for all its
     known tokens at once; only its first chunk has to fit the budget.
Admission stops at the first request that does not fit (no overtaking), so the oldest waiting
request is the next one in. While requests run, admission keeps `watermark` blocks free so the
decodes of the next steps rarely have to preempt.
A prefill chunk of a stateful model ends early on a block boundary where its state is
checkpointed for the prefix cache (BlockManager.align_chunk).

Preemption: when a decode needs a block and none is available, the newest running request that
frees at least one block is the victim (it has the least work invested, and the arrival order of
the rest is kept; one whose blocks are all shared would free nothing). Only requests not older
than the one asking are candidates, and the asker may be its own victim. `_preempt` is the single
place that decides what happens to a victim: with a Swapper (CPU offload) its KV moves to the host
pool when the policy says so, and swapped requests come back (oldest first) before any waiting
request is admitted; otherwise, or when the host pool is full, it recomputes (drops the blocks;
the request goes back to the front of the waiting queue and re-prefills prompt + generated
tokens, mostly from the prefix cache when its blocks were not evicted meanwhile). A failed swap
fails only that request: it comes back in the batch's `failed` list, and the engine ends it.

Progress: Engine.add_request rejects a request whose prompt + max_new_tokens needs more blocks
than the whole pool. Every other request fits alone, the oldest running request can always
preempt all newer ones, and recompute always frees blocks, so some request advances in every
step and every request finishes. A swapped request needs no more blocks than it held while running,
and new admissions wait for it, so it always gets back in once the older requests move on.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.sequence import Sequence, SequenceStatus
from cb_kernels.engine.swapper import OffloadError, Swapper


@dataclass
class ScheduledBatch:
    """The plan of one step: seqs[i] computes its next num_new_tokens[i] tokens."""

    seqs: list = field(default_factory=list)
    num_new_tokens: list = field(default_factory=list)
    blocks_to_copy: list = field(default_factory=list)     # (src, dst) copy-on-write pairs
    failed: list = field(default_factory=list)   # requests a failed swap ended (no blocks held)
    prompt_logprobs: list = field(default_factory=list)  # indices of seqs scoring prompt tokens
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    def add(self, seq: Sequence, num_new_tokens: int, decode: bool) -> None:
        if not decode and seq.prompt_logprobs is not None and seq.wants_prompt_logprobs:
            self.prompt_logprobs.append(len(self.seqs))
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        if decode:
            self.num_decode_tokens += num_new_tokens
        else:
            self.num_prefill_tokens += num_new_tokens


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int,
                 watermark: float = 0.01, swapper: Swapper | None = None):
        if max_num_seqs > max_batch_tokens:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) must be <= max_batch_tokens "
                             f"({max_batch_tokens})")
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque = deque()
        self.running: list = []          # sorted by arrival (seq_id)
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.swapper = swapper
        self.swapped: list = []          # sorted by arrival (seq_id)
        self._failed: list = []          # ended by a failed swap; handed over by schedule()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        bm.begin_step()
        batch = ScheduledBatch()
        budget, prefilling = self._schedule_decodes(batch, self.max_batch_tokens)
        for seq in prefilling:
            if budget == 0:
                break
            n = bm.align_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            self._add(batch, seq, n, decode=False)
            budget -= n
        if self.swapped:
            budget = self._schedule_swapped(batch, budget)
        while self.waiting and not self.swapped and budget > 0 \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt logprobs need every prompt position's logits: no prefix-cache hits then.
            hits = [] if seq.prompt_logprobs is not None and seq.wants_prompt_logprobs \
                else bm.match_prefix(seq)
            reserve = self.watermark_blocks if self.running else 0
            if not bm.can_allocate(seq, hits, reserve):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            n = bm.align_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            self._add(batch, seq, n, decode=False)
            budget -= n
        batch.failed, self._failed = self._failed, []
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int):
        """Schedule one token for each decoding request, oldest first, preempting the newest
        when blocks run out. Returns the budget left and the running requests that prefill."""
        bm, running = self.block_manager, self.running
        seqs, counts, bs = batch.seqs, batch.num_new_tokens, bm.block_size
        prefilling = []
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            if computed != len(seq.token_ids) - 1:
                prefilling.append(seq)
                i += 1
                continue
            copies = bm.try_append_slot(seq)
            while copies is None:
                victim = self._pick_victim(i)
                self._preempt(victim)
                if victim is seq:
                    break
                copies = bm.try_append_slot(seq)
            if copies is None:
                continue        # preempted itself; running[i] is now the next request
            if copies:
                batch.blocks_to_copy += copies
            seqs.append(seq)
            counts.append(1)
            if (computed + 1) % bs == 0:
                bm.commit(seq, computed + 1)
            budget -= 1
            i += 1
        batch.num_decode_tokens = len(seqs)
        return budget, prefilling

    def _pick_victim(self, i: int) -> Sequence:
        """The newest of running[i:] that frees a block, else the newest (progress)."""
        refs = self.block_manager.ref_counts
        for seq in reversed(self.running[i:]):
            if any(refs[b] == 1 for b in seq.block_table):
                return seq
        return self.running[-1]

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring swapped requests back, oldest first, while blocks, budget and seats allow."""
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            reserve = self.watermark_blocks if self.running else 0
            if self.swapper.blocks_to_swap_in(seq) + reserve > bm.num_free_blocks:
                break
            self.swapped.pop(0)
            try:
                self.swapper.swap_in(seq)
            except OffloadError as e:
                self._fail(seq, str(e))
                continue
            bisect.insort(self.running, seq, key=_arrival)
            if seq.is_decoding:
                batch.blocks_to_copy += bm.append_slot(seq)
                self._add(batch, seq, 1, decode=True)
                budget -= 1
            else:
                n = bm.align_chunk(seq, min(seq.num_uncomputed_tokens, budget))
                self._add(batch, seq, n, decode=False)
                budget -= n
        return budget

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int, decode: bool) -> None:
        batch.add(seq, n, decode)
        self.block_manager.commit(seq, seq.num_computed_tokens + n)

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq`'s device blocks away. Recompute: free them (the prefix cache keeps their
        KV until evicted) and put `seq` at the front of the waiting queue."""
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        if self.swapper is not None and self.swapper.choose(seq) == "swap":
            try:
                self.swapper.swap_out(seq)
            except OffloadError as e:
                self.block_manager.free(seq)
                self._fail(seq, str(e))
                return
            bisect.insort(self.swapped, seq, key=_arrival)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_recomputes += 1

    def _fail(self, seq: Sequence, message: str) -> None:
        """End `seq` (which holds no device block) with an error; the next batch reports it."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        seq.error = message
        self._failed.append(seq)

    def fork(self, parent: Sequence, children: list) -> None:
        """Start `children` (the other samples of `parent`'s request, each holding the prompt and
        its own first token) from `parent`'s blocks: shared, the partial last block copied when
        one of them writes into it. Children beyond max_num_seqs wait at the front of the queue
        and prefill (mostly from the prefix cache) once a seat is free; so does every child of a
        parent that holds no blocks any more."""
        waiting = []
        for child in children:
            if parent.status is SequenceStatus.RUNNING and len(self.running) < self.max_num_seqs:
                self.block_manager.fork(parent, child)
                child.status = SequenceStatus.RUNNING
                bisect.insort(self.running, child, key=_arrival)
            else:
                child.status = SequenceStatus.WAITING
                waiting.append(child)
        self.waiting.extendleft(reversed(waiting))

    def finish(self, seq: Sequence) -> None:
        """Remove an ended request (finished, cancelled or failed) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swapper.drop(seq)
        seq.status = SequenceStatus.FINISHED

    def seqs_holding_blocks(self) -> list:
        return list(self.running)
