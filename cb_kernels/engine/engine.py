"""The Engine: requests in, tokens out, one `schedule -> run -> postprocess` step at a time."""
from __future__ import annotations

import logging
import time
from typing import Optional

from cb_kernels.engine import requests
from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import EngineConfig, RequestOutput, SamplingParams
from cb_kernels.engine.cuda_graphs import adapter_decode_runner, graphs_enabled
from cb_kernels.engine.frontend import EngineFrontend
from cb_kernels.engine.pipeline import LaunchedStep, StepClock, fill_placeholders, placeholder_rows
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.scheduler import ScheduledBatch, Scheduler
from cb_kernels.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from cb_kernels.engine.sizing import ModelShape, resolve
from cb_kernels.engine.streams import StreamOrchestrator
from cb_kernels.engine.swapper import make_swapper
from cb_kernels.ops.sampling import greedy_tokens

logger = logging.getLogger("cb_kernels.engine")


class Engine(EngineFrontend):
    """Continuous batching for one transformers causal LM (see DESIGN.md, "Engine API").

    The model runs as given (call model.eval() first if it has dropout layers); its config is
    switched to our attention only for the duration of each step. `seed` seeds the generator of
    sampled requests that have no seed of their own. Not thread-safe: call it from one thread.
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tokenizer=None, seed: int = 0):
        from cb_kernels.hf.adapter import ModelAdapter

        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(model, attention_backend=config.attention_backend,
                                    pack_weights=config.pack_weights,
                                    greedy_head=config.greedy_head)
        a = self.adapter
        self.resolved = resolve(config, ModelShape(a.num_layers, a.num_kv_heads, a.head_dim,
                                                   a.max_positions, a.dtype, a.device))
        r = self.resolved
        a.allocate_cache(r.num_blocks, r.block_size, r.dtype)
        self.block_manager = BlockManager(r.num_blocks, r.block_size, r.prefix_caching)
        self.streams = StreamOrchestrator(a.device, r.overlap)
        self.swapper = make_swapper(self.block_manager, a.k_caches + a.v_caches, r.cpu_offload_gib,
                                    r.preemption, self.streams)
        self.scheduler = Scheduler(self.block_manager, r.max_batch_tokens, r.max_num_seqs,
                                   swapper=self.swapper)
        self.graphs = None
        if graphs_enabled(config.cuda_graphs, a.device):
            max_blocks = min(r.num_blocks, -(-a.max_positions // r.block_size))
            self.graphs = adapter_decode_runner(a, r.max_num_seqs, max_blocks)
        self.sampler = Sampler(seed)
        self.eos_token_ids = requests.eos_ids_of(model)
        self._seqs: dict = {}                 # request_id -> Sequence, while not ended
        self._ended: list = []                # outputs of requests that ended between steps
        self._next_id = 0
        self._steps = 0
        self._failed_steps = 0
        self._num_generated = 0
        self._overlap = r.overlap == "on"     # pipelined steps (pipeline.py)
        self._in_flight: Optional[LaunchedStep] = None
        self.clock = StepClock(a.device.type == "cuda")
        self._overlapped_steps = 0
        self._num_filled = 0
        self._num_discarded = 0
        self._greedy_head_steps = 0

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue one request; returns its id. Raises ValueError/TypeError (naming the argument)
        for a bad prompt, bad params or a duplicate id; nothing is queued then."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = requests.to_token_ids(prompt, self.tokenizer)
        requests.check_prompt(token_ids, params, self.adapter.vocab_size,
                              self.adapter.max_positions, self.block_manager)
        if request_id is None:
            request_id = f"req_{self._next_id}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        seq = Sequence(self._next_id, request_id, token_ids, params, time.perf_counter(),
                       self.eos_token_ids)
        self._next_id += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def cancel(self, request_id: str) -> None:
        """End a waiting or running request now; its blocks return at once and its output
        (finish_reason "cancelled") comes with the next step(). The output holds the tokens shown
        so far: with overlap on, a token still being computed for it is dropped."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not waiting or running (unknown, or "
                             "already finished)")
        self._end(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batch; returns the RequestOutputs of the requests that ended (plus those
        cancelled since the last step).

        With overlap on, the batch is launched before the tokens of the one in flight are read
        (pipeline.py): the outputs are then those of the requests that ended in the previous
        batch, and this one stays in flight until the next call.
        """
        prev, self._in_flight = self._in_flight, None
        retired = self._advance(prev, retire=True) if prev is not None else set()
        batch = self.scheduler.schedule()
        launched = error = None
        if batch.seqs:
            self._steps += 1
            self._overlapped_steps += prev is not None
            try:
                launched = self._launch(batch, prev)
                self.clock.launch_s += launched.launch_s
            except Exception as e:  # one bad step fails its requests, never the engine
                error = e
        if prev is not None:
            self._resolve(prev, retired)
        for seq in self.scheduler.failed:     # a swap failed: that request alone ends
            self._end(seq, "error", seq.error)
        self.scheduler.failed.clear()
        if error is not None:
            self._fail_step(batch, error)
        elif launched is not None:
            self._commit_late(launched)
            if not any(self._seqs.get(seq.request_id) is seq for seq in batch.seqs):
                self._num_discarded += len(launched.sampled)   # all stopped in `prev`
            elif self._overlap and launched.pending:
                self._in_flight = launched
            else:
                self._resolve(launched, self._advance(launched, retire=False))
        elif prev is None and self.scheduler.has_unfinished():
            # Cannot happen while add_request rejects requests that never fit (see scheduler.py);
            # raising beats spinning forever in generate() if that proof ever breaks.
            raise RuntimeError(f"the scheduler found nothing to run: {self.stats()}")
        if not self._seqs:
            self.clock.idle()
        ended, self._ended = self._ended, []
        return ended

    def _launch(self, batch: ScheduledBatch, prev: Optional[LaunchedStep]) -> LaunchedStep:
        """Issue `batch` to the device; placeholders are filled from `prev`'s tokens there."""
        a, start = self.adapter, time.perf_counter()
        self.streams.begin_compute()
        a.copy_blocks(batch.blocks_to_copy)
        input_ids, position_ids, logits_idx, step, sampled = a.prepare(batch.seqs,
                                                                       batch.num_new_tokens)
        dst, src, late_commits = placeholder_rows(batch, prev, a.block_size)
        if dst:
            fill_placeholders(input_ids[0], dst, src, prev.device_tokens, self.streams.to_device)
            self._num_filled += len(dst)
        event = self.clock.start()
        greedy = bool(sampled) and all(seq.params.greedy for seq in sampled)
        device_tokens = None
        if self.graphs is not None and batch.num_prefill_tokens == 0:
            # The graph copies input_ids (placeholders already filled) into its static buffer.
            logits = self.graphs({"input_ids": input_ids[0], "positions": position_ids[0],
                                  "slot_mapping": step.slot_mapping, "seq_lens": step.seq_lens,
                                  "block_tables": step.block_tables,
                                  "cu_seqlens_q": step.cu_seqlens_q})
        elif greedy:
            logits, device_tokens = a.forward_greedy(input_ids, position_ids, logits_idx, step)
            self._greedy_head_steps += device_tokens is not None
        else:
            logits = a.forward(input_ids, position_ids, logits_idx, step)
        if greedy:
            # Greedy ids come back on the d2h stream behind an event (on CPU: a plain copy).
            if device_tokens is None:
                device_tokens = greedy_tokens(logits)
            self.clock.end(event)
            tokens = self.streams.tokens_to_host(device_tokens)
        else:
            tokens = self.sampler(logits, sampled) if sampled else []
            self.clock.end(event)
        return LaunchedStep(batch, sampled, tokens, device_tokens, start,
                            time.perf_counter() - start, late_commits)

    def _advance(self, launched: LaunchedStep, retire: bool) -> set:
        """The bookkeeping of `launched` that needs no token: computed counts grow and each
        sampling sequence gets a PLACEHOLDER last token. With `retire`, a sequence that surely
        ends in that step (max_new_tokens) gives its blocks back now, so the next schedule does
        not spend a row on it. Returns the seq ids retired."""
        now, retired, live = time.perf_counter(), set(), self._seqs
        for seq, n in zip(launched.batch.seqs, launched.batch.num_new_tokens):
            if live.get(seq.request_id) is not seq:
                continue          # cancelled while in flight
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

    def _resolve(self, launched: LaunchedStep, retired: set) -> None:
        """Read `launched`'s tokens (waiting for them if needed), write them over the
        placeholders and end the requests that stop."""
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
        now, live = time.perf_counter(), self._seqs
        for seq, token in zip(launched.sampled, tokens):
            if live.get(seq.request_id) is not seq:
                self._num_discarded += 1    # cancelled, or stopped in the step before
                continue
            assert seq.token_ids[-1] == PLACEHOLDER, f"{seq} lost its placeholder"
            seq.token_ids[-1] = token
            m = seq.metrics
            m.token_times.append(now)
            if m.first_token_time is None:
                m.first_token_time = now
            self._num_generated += 1
            reason = seq.check_stop(token)
            if seq.status is SequenceStatus.FINISHED and seq.seq_id not in retired:
                # A failed swap ended it; its error output comes next, unless this token had
                # ended it first (as the synchronous path sees it: it never swapped then).
                if reason is not None:
                    self.scheduler.failed.remove(seq)
                    self._end(seq, reason)
                continue
            assert reason is not None or seq.seq_id not in retired, f"{seq} retired early"
            if reason is not None:
                self._end(seq, reason)

    def _commit_late(self, launched: LaunchedStep) -> None:
        """Prefix-cache hashes of the blocks that held a placeholder when `launched` was
        scheduled (BlockManager.commit skipped them); their tokens are known now."""
        for seq, n in launched.late_commits:
            if self._live(seq) and seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit(seq, seq.num_computed_tokens + n)

    def _live(self, seq: Sequence) -> bool:
        return self._seqs.get(seq.request_id) is seq

    def _fail_step(self, batch: ScheduledBatch, error: Exception) -> None:
        self._failed_steps += 1
        message = f"{type(error).__name__}: {error}"
        logger.error("step %d failed; failing its %d requests: %s", self._steps, len(batch.seqs),
                     message)
        self.block_manager.discard_step_hashes()
        for seq in batch.seqs:
            if self._live(seq):
                self._end(seq, "error", message)

    def _end(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finished_time = time.perf_counter()
        del self._seqs[seq.request_id]
        self._ended.append(self._output(seq, seq.output_token_ids))

    def _output(self, seq: Sequence, token_ids: list, text: Optional[str] = None) -> RequestOutput:
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(token_ids), text,
                             seq.finish_reason, seq.error, seq.metrics)
