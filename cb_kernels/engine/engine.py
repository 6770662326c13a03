"""The Engine: requests in, tokens out, one `schedule -> run -> postprocess` step at a time."""
from __future__ import annotations

import logging
import time
from typing import Iterator, Optional

from cb_kernels import ops
from cb_kernels.engine import distributed, requests, sizing
from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import EngineConfig, RequestOutput, SamplingParams
from cb_kernels.engine.frontend import Frontend
from cb_kernels.engine.pipeline import OverlapPipeline
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.scheduler import ScheduledBatch, Scheduler
from cb_kernels.engine.sequence import Sequence, SequenceStatus
from cb_kernels.engine.sizing import ModelShape, resolve
from cb_kernels.engine.state_slots import EMPTY_STATS, StateSlots
from cb_kernels.engine.step import LaunchedStep, StepClock
from cb_kernels.engine.streams import StreamOrchestrator
from cb_kernels.engine.swapper import make_swapper
from cb_kernels.engine.weights import WeightWatch
from cb_kernels.runner import ModelRunner, TransformersRunner

logger = logging.getLogger("cb_kernels.engine")


class Engine:
    """Continuous batching for one transformers causal LM (see DESIGN.md, "Engine API").

    The model runs as given (call model.eval() first if it has dropout layers); its config is
    switched to our attention only for the duration of each step. `seed` seeds the generator of
    sampled requests that have no seed of their own. `runner` replaces the default
    TransformersRunner (cb_kernels.runner.ModelRunner says what it must provide). Not
    thread-safe: call it from one thread.
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tokenizer=None,
                 seed: int = 0, runner: Optional[ModelRunner] = None):
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        # Tensor parallelism (engine/distributed.py): None at size 1, else splits the model.
        self.tp = distributed.setup(model, config, runner)
        if self.tp is not None:
            config = self.tp.config       # with what TP switches off (logged)
        self.config, self.tokenizer = config, tokenizer
        if runner is None:
            with distributed.building(self.tp):
                runner = TransformersRunner(
                    model, attention_backend=config.attention_backend,
                    pack_weights=config.pack_weights, greedy_head=config.greedy_head,
                    cuda_graphs=config.cuda_graphs,
                    available_host_bytes=sizing.host_available_bytes()
                    if config.pack_weights == "auto" else None)
        elif not isinstance(runner, ModelRunner):
            raise TypeError(f"runner must implement cb_kernels.runner.ModelRunner, got "
                            f"{type(runner).__name__}")
        self.runner = r = runner
        state_bytes = getattr(r, "state_bytes_per_seq", 0)     # stateful layers' state
        self.resolved = c = resolve(config, ModelShape(r.num_layers, r.num_kv_heads, r.head_dim,
                                                       r.max_positions, r.dtype, r.device,
                                                       state_bytes))
        if self.tp is not None:
            self.resolved = c = self.tp.agree(c)
        r.allocate_cache(c.num_blocks, c.block_size, c.dtype, c.max_num_seqs)
        if self.tp is not None:
            self.runner = r = self.tp.wrap(r)
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.prefix_caching)
        if state_bytes:       # one state slot per running request (engine/state_slots.py)
            self.block_manager.state_slots = StateSlots(c.max_num_seqs, r.state_tensors,
                                                        state_bytes)
        self.streams = StreamOrchestrator(r.device, c.overlap)
        self.swapper = make_swapper(self.block_manager, r.k_caches + r.v_caches,
                                    c.cpu_offload_gib, c.preemption, self.streams)
        if self.swapper is None and c.preemption != "recompute":
            if c.preemption == "swap":
                raise ValueError(f"preemption='swap' needs a host pool, but cpu_offload_gib="
                                 f"{c.cpu_offload_gib:.3g} holds no KV block; raise "
                                 "cpu_offload_gib or use preemption='recompute'")
            self.resolved = c = sizing.replace(c, preemption="recompute", cpu_offload_gib=0.0)
            logger.info("EngineConfig.preemption auto -> recompute (no host pool)")
        self.scheduler = Scheduler(self.block_manager, c.max_batch_tokens, c.max_num_seqs,
                                   swapper=self.swapper)
        self.sampler = Sampler(seed)
        self.pipeline = OverlapPipeline(self) if c.overlap == "on" else None
        self.frontend = Frontend(self)
        self.weights = WeightWatch(model)
        self.clock = StepClock(r.device.type == "cuda")
        self._seqs: dict = {}                 # request_id -> Sequence, while not ended
        self._groups: dict = {}               # request_id -> SampleGroup of n > 1, once forked
        self._ended: list = []                # outputs of requests that ended between steps
        self._next_id = 0
        self._user_ids: set = set()           # ids of the automatic form the caller chose
        self.num_steps = self.num_failed_steps = 0
        self.num_generated_tokens = self.num_greedy_head_steps = 0

    # -- requests -------------------------------------------------------------------------------
    def check_request(self, prompt, params: Optional[SamplingParams] = None) -> tuple:
        """(token_ids, params) of a request add_request would accept; raises ValueError/TypeError
        (naming the argument) as add_request does. Queues nothing."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = requests.to_token_ids(prompt, self.tokenizer)
        requests.check_params(params, self.runner.vocab_size, self.tokenizer)
        requests.check_prompt(token_ids, params, self.runner.vocab_size,
                              self.runner.max_positions, self.block_manager)
        return token_ids, params

    def add_request(self, prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue one request; returns its id. Raises ValueError/TypeError (naming the argument)
        for a bad prompt, bad params or a duplicate id; nothing is queued then. An automatic id
        ("req_N") skips every "req_..." id the caller ever chose, so the two never collide."""
        token_ids, params = self.check_request(prompt, params)
        if request_id is None:
            while f"req_{self._next_id}" in self._seqs or f"req_{self._next_id}" in self._user_ids:
                self._next_id += 1
            request_id = f"req_{self._next_id}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        elif request_id.startswith("req_"):
            self._user_ids.add(request_id)
        if request_id in self._seqs or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        seq = Sequence(self._next_id, request_id, token_ids, params, time.perf_counter(),
                       self.runner.eos_token_ids)
        self._next_id += 1
        if params.sampling:     # an unseeded request's seed comes from Engine(seed) in add order
            self.sampler.seed_of(seq)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def reject(self, prompt, error: Exception) -> RequestOutput:
        """The "error" output of a prompt add_request refused (generate/stream report it)."""
        out = requests.error_output(f"req_rejected_{self._next_id}", prompt, error)
        self._next_id += 1
        return out

    def cancel(self, request_id: str) -> None:
        """End a waiting or running request now; its blocks return at once and its output
        (finish_reason "cancelled") comes with the next step(). The output holds the tokens shown
        so far: with overlap on, a token still being computed for it is dropped."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None and isinstance(request_id, str) and request_id in self._groups:
            seq = self._groups[request_id].root      # ended, but other samples still run
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not waiting or running (unknown, or "
                             "already finished)")
        for sample in seq.group.samples if seq.group is not None else [seq]:
            if self.is_live(sample):
                self.end(sample, "cancelled")

    def has_unfinished(self) -> bool:
        """True while a request is waiting, running or swapped, or an ended one's output has
        not been returned by step() yet (so `while has_unfinished(): step()` gets them all)."""
        return bool(self._seqs or self._ended)

    @property
    def eos_token_ids(self) -> frozenset:
        """The ids that end a request (unless ignore_eos), as the model's generate() sees them."""
        return self.runner.eos_token_ids

    def sequence(self, request_id: str) -> Optional[Sequence]:
        """The live Sequence of a waiting or running request, else None."""
        return self._seqs.get(request_id)

    def is_live(self, seq: Sequence) -> bool:
        return self._seqs.get(seq.request_id) is seq

    def defer(self, outputs: list) -> None:
        """Outputs that the next step() returns (ended requests another caller did not want)."""
        self._ended += outputs

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batch; returns the RequestOutputs of the requests that ended (plus those
        cancelled since the last step). With overlap on, the batch stays in flight and the
        outputs are those of the batch before (engine/pipeline.py). An exception that is not
        an Exception (KeyboardInterrupt, SystemExit) fails the step's requests as any error
        does, then propagates; their outputs come with the next step()."""
        self.check_weights()
        if self.pipeline is not None:
            self.pipeline.step()
        else:
            batch = self.scheduler.schedule()
            self.end_failed(batch)
            if batch.seqs:
                try:
                    launched = self.run(batch)
                    self.block_manager.end_step()
                    self.postprocess(launched)
                except BaseException as e:  # one bad step fails its requests, never the engine
                    self.fail_step(batch, e)
                    if not isinstance(e, Exception):
                        raise
            else:
                self.check_progress()
        if not self._seqs:
            self.clock.idle()
        ended, self._ended = self._ended, []
        return ended

    def run(self, batch: ScheduledBatch, prev: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Issue `batch` to the runner; with overlap, placeholders are filled from `prev`'s
        tokens on the device. Greedy tokens travel to the host behind an event."""
        self.num_steps += 1
        r, start = self.runner, time.perf_counter()
        self.streams.begin_compute()
        r.copy_blocks(batch.blocks_to_copy)
        inputs = r.prepare(batch.seqs, batch.num_new_tokens)
        late_commits = [] if prev is None else self.pipeline.fill(batch, prev, inputs.input_ids)
        sampled, event, prompt_rows = inputs.sampled, self.clock.start(), None
        if batch.prompt_logprobs:     # requests that asked for prompt logprobs prefill here
            inputs.logits_indices, prompt_rows = self.sampler.prompt_rows(batch,
                                                                          inputs.logits_indices)
        greedy = bool(sampled) and not prompt_rows and all(seq.params.greedy for seq in sampled)
        out = r.execute(inputs, greedy)
        device_tokens = None
        if greedy:
            self.num_greedy_head_steps += out.tokens is not None
            device_tokens = out.tokens if out.tokens is not None else ops.greedy_tokens(out.logits)
            self.clock.end(event)
            tokens = self.streams.tokens_to_host(device_tokens)
        else:
            tokens = self.sampler(out.logits, sampled, prompt_rows) if sampled or prompt_rows \
                else []
            self.clock.end(event)
        launch_s = time.perf_counter() - start
        self.clock.launch_s += launch_s
        return LaunchedStep(batch, sampled, tokens, device_tokens, start, launch_s, late_commits)

    def postprocess(self, launched: LaunchedStep) -> None:
        """Count the computed tokens, append each sampled token, end the requests that stop."""
        self.advance(launched.batch)
        for seq, token in zip(launched.sampled, self.wait_tokens(launched)):
            seq.token_ids.append(token)
            reason = self.accept_token(seq, token)
            if reason is not None:
                self.end(seq, reason)

    # -- the parts of a step (the pipeline shares them) -----------------------------------------
    def advance(self, batch: ScheduledBatch) -> list:
        """Grow each live sequence's computed count by its share of `batch`; returns the
        (seq, num_new_tokens) of the live ones."""
        now, live = time.perf_counter(), []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if self.is_live(seq):          # else cancelled while in flight
                seq.num_computed_tokens += n
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = now
                live.append((seq, n))
        return live

    def wait_tokens(self, launched: LaunchedStep) -> list:
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

    def accept_token(self, seq: Sequence, token: int) -> Optional[str]:
        """Record `token` (already the last of seq.token_ids); returns the stop reason or None."""
        now, m = time.perf_counter(), seq.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        self.num_generated_tokens += 1
        if seq.group is not None and seq.group.pending:
            self.fork(seq)
        return seq.check_stop(token, self.tokenizer)

    def fork(self, root: Sequence) -> None:
        """The other samples of `root`'s request (n > 1), drawn with its first token, start from
        its prompt KV: shared blocks, copy-on-write of the partial last one (scheduler.fork)."""
        children = root.group.take_pending()
        self._groups[root.request_id] = root.group
        for child in children:
            child.seq_id = self._next_id
            self._next_id += 1
            self._seqs[child.request_id] = child
        self.scheduler.fork(root, children)
        for child in children:
            reason = self.accept_token(child, child.token_ids[-1])
            if reason is not None:
                self.end(child, reason)

    def end_failed(self, batch: ScheduledBatch) -> None:
        for seq in batch.failed:      # a swap failed: that request alone ends
            self.end(seq, "error", seq.error)
        batch.failed.clear()

    def check_progress(self) -> None:
        if self.scheduler.has_unfinished():
            # Cannot happen while add_request rejects requests that never fit (scheduler.py);
            # raising beats spinning forever in generate() if that proof ever breaks.
            raise RuntimeError(f"the scheduler found nothing to run: {self.stats()}")

    def fail_step(self, batch: ScheduledBatch, error: BaseException) -> None:
        self.num_failed_steps += 1
        message = f"{type(error).__name__}: {error}"
        logger.error("step %d failed; failing its %d requests: %s", self.num_steps,
                     len(batch.seqs), message)
        self.block_manager.discard_step_hashes()
        for seq in batch.seqs:
            if self.is_live(seq):
                self.end(seq, "error", message)

    def end(self, seq: Sequence, reason: str, error: Optional[str] = None) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        if seq.has_placeholder:      # ended inside an overlapped step (interrupted)
            seq.token_ids.pop()
        seq.finish_reason, seq.error = reason, error
        seq.metrics.finished_time = time.perf_counter()
        del self._seqs[seq.request_id]
        out = requests.output_of(seq, seq.output_token_ids, self.tokenizer)
        if out is not None:     # None: other samples of the request still run
            self._ended.append(out)
            if seq.group is not None:
                self._groups.pop(out.request_id, None)

    # -- front end and introspection ------------------------------------------------------------
    def generate(self, prompts, params=None) -> list:
        """Run `prompts` to completion; RequestOutputs in prompt order (engine/frontend.py).
        Tensor parallel: rank 0's prompts run; every rank returns their outputs."""
        if self.tp is not None:
            return self.tp.generate(self, prompts, params)
        return self.frontend.generate(prompts, params)

    def stream(self, prompts, params=None) -> Iterator[RequestOutput]:
        """Per step, one RequestOutput per request with new tokens (engine/frontend.py).
        Tensor parallel: the other ranks yield rank 0's final outputs once it is done."""
        if self.tp is not None:
            return self.tp.stream(self, prompts, params)
        return self.frontend.stream(prompts, params)

    def check_weights(self, full: bool = False) -> None:
        """Drop the prefix cache if a parameter was written through torch or replaced since the
        last check (engine/weights.py; every step() does this, `full` (once per generate() and
        stream()) also sees Parameter objects swapped for new ones)."""
        if full:
            self.weights.refresh_list()
        if self.weights.changed():
            self.block_manager.reset_prefix_cache()

    def weights_updated(self) -> None:
        """Say the model's weights changed in a way torch cannot see (`p.data.copy_(...)`,
        writes to inference tensors, new Parameter objects): the runner rebuilds its copies of
        them and the prefix cache forgets every block, so no request reads KV of the old weights.
        Requests running now keep the KV they have (computed with the old weights)."""
        self.runner.refresh_weights()
        self.weights.refresh_list()
        self.weights.changed()
        self.block_manager.reset_prefix_cache()

    def refresh_weights(self) -> None:
        """= weights_updated() (the older name)."""
        self.weights_updated()

    def check_invariants(self) -> None:
        """Raise AssertionError if any block, ref count or queue is inconsistent."""
        s = self.scheduler
        self.block_manager.check_invariants(s.seqs_holding_blocks(), between_steps=True)
        for seq in s.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} in running"
            assert self.is_live(seq), f"{seq} running but unknown"
        for seq in s.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq} waiting"
        if self.swapper is not None:
            self.swapper.check_invariants(s.swapped)
        assert not s.swapped or self.swapper is not None, "swapped requests without a host pool"
        assert len(s.running) + len(s.waiting) + len(s.swapped) == len(self._seqs), \
            "a request is lost"
        assert len(s.running) <= s.max_num_seqs
        for seq in self._seqs.values():
            assert not seq.has_placeholder, f"{seq} keeps a placeholder between steps"
        if self.pipeline is not None:
            self.pipeline.check_invariants()

    def stats(self) -> dict:
        """Counters and gauges: blocks, offload, preemption, steps; of the overlap pipeline
        (zeros when it is off) overlapped_steps, placeholder_fills, discarded_tokens; StepClock's
        host_wait_s, launch_s and (CUDA, clock.device_events on) device_busy_s, device_idle_s,
        timed_steps; greedy_head_steps: steps whose tokens came from the greedy head;
        state_slots_used, state_slots_total, state_bytes_per_slot, state_fork_copies: the state
        slots of a hybrid / recurrent model (engine/state_slots.py; zeros for other models);
        tensor_parallel_size and local_num_kv_heads (the KV heads this rank's pool holds)."""
        bm, s = self.block_manager, self.scheduler
        pipeline = (self.pipeline or OverlapPipeline(self)).stats()
        offload = self.swapper.offload.stats() if self.swapper is not None else \
            {"host_used_blocks": 0, "host_total_blocks": 0, "host_occupancy": 0.0,
             "swaps_out": 0, "swaps_in": 0, "swap_blocks_out": 0, "swap_blocks_in": 0,
             "swap_bytes": 0, "swap_failures": 0}
        return {
            "used_blocks": bm.num_used_blocks, "free_blocks": len(bm.free_ids),
            "cached_blocks": bm.num_cached_blocks, "num_blocks": bm.num_blocks, **offload,
            "recomputes": s.num_recomputes, "preemptions": s.num_preemptions,
            "prefix_hit_blocks": bm.num_hit_blocks, "evicted_blocks": bm.num_evicted_blocks,
            "prefix_resets": bm.num_prefix_resets,
            "steps": self.num_steps, "failed_steps": self.num_failed_steps,
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "generated_tokens": self.num_generated_tokens, **pipeline,
            "greedy_head_steps": self.num_greedy_head_steps, **self.clock.stats(),
            **(bm.state_slots.stats() if bm.state_slots is not None else EMPTY_STATS),
            **(self.tp.stats() if self.tp is not None else
               {"tensor_parallel_size": 1, "local_num_kv_heads": self.runner.num_kv_heads}),
        }
