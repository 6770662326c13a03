"""The Engine: requests in, tokens out, one `schedule -> run -> postprocess` step at a time."""
from __future__ import annotations

import logging
import time
from typing import Iterator, Optional

from cb_kernels.engine import distributed, frontend, offload, requests, rl, sizing
from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import EngineConfig, RequestOutput, SamplingParams
from cb_kernels.engine.frontend import Frontend
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.scheduler import Scheduler
from cb_kernels.engine.sequence import Sequence, SequenceStatus
from cb_kernels.engine.sizing import ModelShape, resolve
from cb_kernels.engine.state_slots import EMPTY_STATS, StateSlots
from cb_kernels.engine.step_loop import StepLoop
from cb_kernels.engine.streams import StreamOrchestrator
from cb_kernels.engine.structured import Grammars
from cb_kernels.engine.table import RequestTable
from cb_kernels.engine.swapper import make_swapper
from cb_kernels.engine.warmup import warm_up
from cb_kernels.engine.weights import WeightWatch
from cb_kernels.runner import ModelRunner, TransformersRunner

logger = logging.getLogger("cb_kernels.engine")


class Engine:
    """Continuous batching for one transformers causal LM (see DESIGN.md, "Engine API").

    The model runs as given (call model.eval() first if it has dropout layers); its config is
    switched to our attention only for the duration of each step. `seed` seeds the generator of
    sampled requests that have no seed of their own. `runner` replaces the default
    TransformersRunner (cb_kernels.runner.ModelRunner says what it must provide); a
    tensor-parallel runner (engine/distributed.build_runner, on every rank) makes this rank's
    engine drive (rank 0) or follow. Not thread-safe: call it from one thread.
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tokenizer=None,
                 seed: int = 0, runner: Optional[ModelRunner] = None):
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if runner is None and config.tensor_parallel_size > 1:
            # Tensor parallelism (engine/distributed.py): this rank's runner, the model split
            runner = distributed.build_runner(model, config)
        own_runner = runner is None
        if runner is None:
            runner = TransformersRunner(
                model, attention_backend=config.attention_backend,
                pack_weights=config.pack_weights, greedy_head=config.greedy_head,
                cuda_graphs=config.cuda_graphs,
                available_host_bytes=sizing.host_available_bytes()
                if config.pack_weights == "auto" else None)
        elif not isinstance(runner, ModelRunner):
            raise TypeError(f"runner must implement cb_kernels.runner.ModelRunner, got "
                            f"{type(runner).__name__}")
        # A tensor-parallel runner: checked, its config agreed over the process group; else None
        self.tp = distributed.adopt(model, config, runner)
        if self.tp is not None:
            config = self.tp.config       # with what TP switches off (logged)
        self.config, self.tokenizer = config, tokenizer
        self.runner = r = runner
        state_bytes = r.state_bytes_per_seq     # stateful layers' state (0: none)
        self.resolved = c = resolve(config, ModelShape(r.num_layers, r.num_kv_heads, r.head_dim,
                                                       r.max_positions, r.dtype, r.device,
                                                       state_bytes))
        if self.tp is not None:
            self.resolved = c = self.tp.agree(c)
        r.allocate_cache(c.num_blocks, c.block_size, c.dtype, c.max_num_seqs)
        # The kernels' scratch for the largest step, faulted in here: the first prefill of a new
        # Engine otherwise wrote multi-MB fresh mmaps (runner.reserve_workspace says more).
        self.workspace_bytes = r.reserve_workspace(c.max_batch_tokens, c.max_num_seqs) \
            if r.device.type == "cpu" else 0
        # One-time costs here, not in the first generate() (engine/warmup.py says which runners).
        self.warmup_s = warm_up(r, c.num_blocks, c.block_size, c.max_batch_tokens,
                                c.max_num_seqs) \
            if own_runner and self.tp is None and not state_bytes and r.device.type == "cpu" \
            else 0.0
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.prefix_caching)
        if state_bytes:       # one state slot per running request (engine/state_slots.py)
            self.block_manager.state_slots = StateSlots(c.max_num_seqs, r.state_tensors,
                                                        state_bytes, c.num_state_checkpoints)
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
        self.table = RequestTable(tokenizer)
        # SamplingParams.structured: compiled on first use (engine/structured.py)
        self.grammars = Grammars(tokenizer, r.vocab_size, r.eos_token_ids)
        self.loop = StepLoop(self.table, self.scheduler, r, Sampler(seed, self.grammars),
                             self.streams, self.swapper, c.overlap == "on", tokenizer)
        self.frontend = Frontend(tokenizer)
        self.model = model
        self.weights = WeightWatch(model)
        self.weight_version = 0       # +1 per weight change seen (RequestOutput.weight_version)
        self._paused = False
        self._asleep = set()          # "kv_cache", "weights": what sleep() freed
        self.sleep_freed_bytes: list = []     # the last sleep()'s bytes, one entry per rank
        distributed.attach(self)      # a follower runs rank 0's RL calls and weight checks

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
        if params.structured is not None:      # cached: the server compiled it off its loop
            self.grammars.compile(params.structured)
        return token_ids, params

    def compile_grammar(self, structured) -> None:
        """Compile a StructuredOutput's grammar into the engine's cache, so a later request with it
        starts at once (safe from another thread: the server compiles off its loop). Raises
        ValueError naming the problem (a bad schema or regex), ImportError without the
        `structured` extra."""
        self.grammars.compile(structured)

    def add_request(self, prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue one request; returns its id. Raises ValueError/TypeError (naming the argument)
        for a bad prompt, bad params or a duplicate id; nothing is queued then. An automatic id
        ("req_N") skips every "req_..." id the caller ever chose, so the two never collide."""
        token_ids, params = self.check_request(prompt, params)
        request_id = self.table.new_request_id(request_id)
        seq = Sequence(self.table.next_seq_id(), request_id, token_ids, params,
                       time.perf_counter(), self.runner.eos_token_ids)
        if params.structured is not None:
            seq.grammar = self.grammars.start(params.structured)
        if params.sampling:     # an unseeded request's seed comes from Engine(seed) in add order
            self.loop.sampler.seed_of(seq)
        self.table.add(seq)
        self.scheduler.add(seq)      # paused: queued, admitted once resume() is called
        return request_id

    def reject(self, prompt, error: Exception) -> RequestOutput:
        """The "error" output of a prompt add_request refused (generate/stream report it)."""
        return self._stamp([self.table.reject(prompt, error)], self.weight_version)[0]

    def cancel(self, request_id: str) -> None:
        """End a waiting or running request now; its blocks return at once and its output
        (finish_reason "cancelled") comes with the next step(). The output holds the tokens shown
        so far: with overlap on, a token still being computed for it is dropped."""
        samples = self.table.samples(request_id)
        if not samples:
            raise ValueError(f"request_id {request_id!r} is not waiting or running (unknown, or "
                             "already finished)")
        for sample in samples:
            if self.table.is_live(sample):
                self.loop.end(sample, "cancelled")

    def has_unfinished(self) -> bool:
        """True while a request is waiting, running or swapped, or an ended one's output has
        not been returned by step() yet (so `while has_unfinished(): step()` gets them all)."""
        return self.table.has_unfinished()

    @property
    def eos_token_ids(self) -> frozenset:
        """The ids that end a request (unless ignore_eos), as the model's generate() sees them."""
        return self.runner.eos_token_ids

    @property
    def max_positions(self) -> int:
        """The longest sequence (prompt + output tokens) the model takes."""
        return self.runner.max_positions

    @property
    def num_pool_tokens(self) -> int:
        """Tokens the KV pool holds (num_blocks * block_size): no request grows past it."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def sequence(self, request_id: str) -> Optional[Sequence]:
        """The live Sequence of a waiting or running request, else None."""
        return self.table.get(request_id)

    def defer(self, outputs: list) -> None:
        """Outputs that the next step() returns (ended requests another caller did not want)."""
        self.table.defer(outputs)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batch: schedule -> launch -> resolve (engine/step_loop.py); returns the
        RequestOutputs of the requests that ended (plus those cancelled since the last step).
        With overlap on, the batch stays in flight and its tokens are resolved in the next
        step(). An exception that is not an Exception (KeyboardInterrupt, SystemExit) fails the
        step's requests as any error does, then propagates; their outputs come with the next
        step().
        Paused or asleep, it computes nothing and returns only outputs already ended (requests
        added meanwhile wait for resume() / wake_up()). Every output carries the
        weight_version its last token was computed with."""
        if self._paused or self._asleep:
            return self._stamp(self.table.take_outputs(), self.weight_version)
        # With overlap on, this step resolves the one launched before the check below.
        version = self.weight_version
        self.check_weights()
        self.loop.step()
        return self._stamp(self.table.take_outputs(),
                           version if self.loop.overlap else self.weight_version)

    def _stamp(self, outputs: list, version: int) -> list:
        for out in outputs:
            if out.weight_version is None:
                out.weight_version = version
        return outputs

    # -- front end and introspection ------------------------------------------------------------
    def generate(self, prompts, params=None) -> list:
        """Run `prompts` to completion; RequestOutputs in prompt order (engine/frontend.py).
        Tensor parallel: rank 0's prompts run; every rank returns their outputs."""
        self._check_runnable("generate()")
        if self.tp is not None:
            return distributed.generate(self, prompts, params)
        return frontend.generate(self, prompts, params)

    def stream(self, prompts, params=None) -> Iterator[RequestOutput]:
        """Per step, one RequestOutput per request with new tokens (engine/frontend.py).
        Tensor parallel: the other ranks yield rank 0's final outputs once it is done."""
        self._check_runnable("stream()")
        if self.tp is not None:
            return distributed.stream(self, prompts, params)
        return frontend.stream(self, prompts, params)

    def _check_runnable(self, what: str) -> None:
        if self._paused or self._asleep:
            raise RuntimeError(f"{what} on a {'paused' if self._paused else 'sleeping'} engine "
                               f"would wait forever; call {'resume' if self._paused else 'wake_up'}"
                               "() first")

    @property
    def rank(self) -> int:
        """This process's rank in a tensor-parallel engine (0 without one). Rank 0 steps the
        engine; the others run its steps in follow() (generate/stream do both on every rank)."""
        return self.tp.rank if self.tp is not None else 0

    def follow(self):
        """Ranks other than 0 of a tensor-parallel engine: run rank 0's steps until rank 0
        calls release(); returns what it released (the runner's serve())."""
        if self.tp is None:
            raise RuntimeError("follow() is for the ranks other than 0 of a tensor-parallel "
                               "engine; this engine has tensor_parallel_size=1")
        return self.runner.serve()

    def release(self, outputs=None) -> None:
        """Rank 0 of a tensor-parallel engine, after stepping it itself (add_request/step): end
        the session, so the other ranks' follow() returns `outputs`. A no-op without tensor
        parallelism."""
        if self.tp is not None:
            self.runner.release(outputs)

    def check_weights(self) -> None:
        """If a parameter was written through torch or replaced since the last check
        (engine/weights.py; every step() does this): weight_version + 1, the prefix cache
        forgets every block. The runner's copies follow by themselves (their own checks), except
        after a submodule replacement or an optimizer step (a fused optimizer bumps no version
        counter the runner could see): then the runner rebuilds them."""
        if self.weights.changed():
            if (self.weights.modules_moved or self.weights.optimizer_stepped) \
                    and "weights" not in self._asleep:
                self.runner.refresh_weights()     # rebuilds what holds the old submodules
            self._new_weights()

    def _new_weights(self) -> None:
        self.weight_version += 1
        self.frontend.weight_version = self.weight_version
        self.block_manager.reset_prefix_cache()
        if self.tp is not None and self.rank == 0:
            self.runner.weight_version = self.weight_version     # sent with every step

    def weights_updated(self) -> None:
        """Say the model's weights changed in a way torch cannot see (`p.data.copy_(...)`,
        writes to inference tensors): the runner rebuilds its copies of them, weight_version
        + 1, and the prefix cache forgets every block, so no request reads KV of the old
        weights. Requests running now keep the KV they have (computed with the old weights).
        Tensor parallel: on rank 0 (the others in follow()) or on every rank; every rank
        rebuilds its copies."""
        distributed.everywhere(self, "weights_updated")

    def _weights_updated_here(self) -> int:
        if "weights" not in self._asleep:
            self.runner.refresh_weights()
        self.weights.changed()
        self._new_weights()
        return self.weight_version

    # -- RL (DESIGN.md, "RL surface"; README, "RL") ------------------------------------------------
    def update_weights(self, named_tensors) -> int:
        """Copy (name, tensor) pairs into the model's parameters, by transformers' names
        (`model.named_parameters()`, tied names too: a tied weight is written once); then as
        weights_updated(). Returns the new weight_version. Checks every pair (known name,
        shape) before writing any. Tensor parallel: rank 0 takes the full (unsplit) tensors,
        checks them, and every rank writes its part (engine/distributed.update_weights); the
        other ranks are in follow() or call update_weights too (their argument is not read)."""
        if self.tp is not None:
            return distributed.update_weights(self, named_tensors)
        rl.load_named(self.model, named_tensors)
        return self._weights_updated_here()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (running requests keep theirs). Tensor parallel: on
        rank 0 (the others in follow()) or on every rank."""
        distributed.everywhere(self, "reset_prefix_cache")

    def _reset_prefix_cache_here(self) -> None:
        self.block_manager.reset_prefix_cache()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause(self, mode: str = "keep") -> list:
        """Stop computing. "keep": requests stay as they are and continue unchanged after
        resume(); "wait": the requests admitted so far run to the end first (pause steps the
        engine itself), queued ones stay queued; "abort": every request ends now with the
        tokens and logprobs it has, finish_reason "abort". Returns the outputs of the requests
        that ended inside pause (wait, abort). Paused, add_request queues and step() computes
        nothing; generate()/stream() raise."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'abort', got {mode!r}")
        self._check_awake("pause")
        self._paused, outputs = False, []
        if mode == "wait":
            with rl.admitting_nothing(self.scheduler):
                while self.scheduler.running or self.scheduler.swapped or \
                        self.scheduler.waiting or self.loop.in_flight is not None:
                    outputs += self.step()
        self.loop.settle()
        if mode == "abort":
            for seq in list(self.table.live()):
                if self.table.is_live(seq):
                    self.loop.end(seq, "abort")
        self._paused = True
        return outputs + self._stamp(self.table.take_outputs(), self.weight_version) \
            if mode != "keep" else outputs

    def resume(self) -> None:
        """Undo pause(): steps compute again, queued requests are admitted."""
        self._paused = False

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def sleep(self, level: int = 1, mode: Optional[str] = None) -> int:
        """Free memory for a trainer in the same process; returns the bytes freed. Level 1: the
        KV pool (and state slots) and the prefix cache; level 2 also the runner's private
        weight copies (packed linears and MoE experts, the greedy head's copy) and the runner's
        scratch tensors, the kernels' per-thread scratch (ops/workspace.py) and the MoE op's
        work buffers (the other C++ kernels' small per-thread work buffers stay). The model's
        own weights stay (they are the trainer's). Requests waiting or running: RuntimeError,
        unless mode="wait" (they finish first) or "abort" (they end now); their outputs come
        with the next step().
        Tensor parallel: call it on rank 0 while the others are in follow(), or on every rank
        (as generate()); rank 0's level and mode rule, every rank frees its own pool and
        copies; every rank returns the sum over the ranks, and stats()["sleep_freed_bytes"]
        lists each rank's bytes."""
        if self.tp is not None and self.rank != 0:
            return distributed.everywhere(self, "sleep")
        with distributed.refusing(self, "sleep"):
            if level not in (1, 2):
                raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
            if mode not in (None, "wait", "abort"):
                raise ValueError(f"sleep mode must be None, 'wait' or 'abort', got {mode!r}")
            if self.table.num_live or self.loop.in_flight is not None:
                if mode is None:
                    raise RuntimeError(f"sleep() with {self.table.num_live} requests waiting or "
                                       "running; pass mode='wait' (finish them first) or "
                                       "mode='abort' (end them now)")
                paused = self._paused
                self._paused = False
                if mode == "wait":
                    while self.table.num_live or self.loop.in_flight is not None:
                        self.defer(self.step())
                else:
                    self.defer(self.pause("abort"))
                self._paused = paused
        return distributed.everywhere(self, "sleep", level=level)

    def _sleep_here(self, level: int) -> int:
        """This rank's half of sleep(): the bytes it freed."""
        self.block_manager.reset_prefix_cache()
        kv, weights = "kv_cache" not in self._asleep, level == 2 and "weights" not in self._asleep
        freed = self.runner.release_memory(kv=kv, weights=weights)
        if kv and self.block_manager.state_slots is not None:
            freed += self.block_manager.state_slots.release_checkpoints()
        self._asleep |= {"kv_cache"} | ({"weights"} if level == 2 else set())
        return freed

    def wake_up(self, tags: Optional[list] = None) -> None:
        """Give back what sleep() freed: tags None (all), ["kv_cache"] or ["weights"]; a
        weight copy is rebuilt from the model's weights as they are now. Tensor parallel: as
        sleep(); every rank restores its own."""
        known = ("kv_cache", "weights")
        if self.tp is None or self.rank == 0:
            with distributed.refusing(self, "wake_up"):
                if tags is not None and (isinstance(tags, str) or
                                         any(t not in known for t in tags)):
                    raise ValueError(f"wake_up tags must be None or a list of {known}, got "
                                     f"{tags!r}")
        distributed.everywhere(self, "wake_up", tags=None if tags is None else list(tags))

    def _wake_up_here(self, tags: Optional[list]) -> None:
        wanted = set(("kv_cache", "weights") if tags is None else tags) & self._asleep
        self.runner.restore_memory(kv="kv_cache" in wanted, weights="weights" in wanted)
        if "kv_cache" in wanted and self.block_manager.state_slots is not None:
            self.block_manager.state_slots.restore_checkpoints()
        self._asleep -= wanted

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{what}() on a sleeping engine; call wake_up() first")

    def check_invariants(self) -> None:
        """Raise AssertionError if any block, ref count or queue is inconsistent."""
        s = self.scheduler
        self.block_manager.check_invariants(s.seqs_holding_blocks(), between_steps=True)
        for seq in s.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} in running"
            assert self.table.is_live(seq), f"{seq} running but unknown"
        for seq in s.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq} waiting"
        if self.swapper is not None:
            self.swapper.check_invariants(s.swapped)
        assert not s.swapped or self.swapper is not None, "swapped requests without a host pool"
        assert len(s.running) + len(s.waiting) + len(s.swapped) == self.table.num_live, \
            "a request is lost"
        assert len(s.running) <= s.max_num_seqs
        self.loop.check_invariants()

    def stats(self) -> dict:
        """Counters and gauges: blocks, offload, preemption, steps; of the step loop
        overlapped_steps, placeholder_fills, discarded_tokens (zeros with overlap off); StepClock's
        host_wait_s, launch_s and (CUDA, clock.device_events on) device_busy_s, device_idle_s,
        timed_steps; greedy_head_steps: steps whose tokens came from the greedy head;
        state_slots_used, state_slots_total, state_bytes_per_slot, state_fork_copies: the state
        slots of a hybrid / recurrent model (engine/state_slots.py; zeros for other models);
        state_checkpoints_used, state_checkpoints_total, state_checkpoint_saves,
        state_checkpoint_hits, state_checkpoint_evictions: its prefix cache's state checkpoints;
        tensor_parallel_size and local_num_kv_heads (the KV heads this rank's pool holds);
        weight_version, paused, sleeping (what sleep() freed: "kv_cache", "weights"),
        sleep_freed_bytes (the last sleep()'s bytes freed, one entry per rank)."""
        bm, s = self.block_manager, self.scheduler
        return {
            "used_blocks": bm.num_used_blocks, "free_blocks": len(bm.free_ids),
            "cached_blocks": bm.num_cached_blocks, "num_blocks": bm.num_blocks,
            **(self.swapper.offload.stats() if self.swapper is not None else
               offload.EMPTY_STATS),
            "recomputes": s.num_recomputes, "preemptions": s.num_preemptions,
            "prefix_hit_blocks": bm.num_hit_blocks, "evicted_blocks": bm.num_evicted_blocks,
            "prefix_resets": bm.num_prefix_resets,
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            **self.loop.stats(),
            **(bm.state_slots.stats() if bm.state_slots is not None else EMPTY_STATS),
            "tensor_parallel_size": self.tp.size if self.tp is not None else 1,
            "weight_version": self.weight_version, "paused": self._paused,
            "sleeping": sorted(self._asleep), "sleep_freed_bytes": list(self.sleep_freed_bytes),
            "local_num_kv_heads": self.runner.num_kv_heads,
        }
