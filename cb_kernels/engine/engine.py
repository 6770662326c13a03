"""The Engine: requests in, tokens out, one `schedule -> run -> postprocess` step at a time."""
from __future__ import annotations

import logging
import time
from typing import Iterator, Optional

from cb_kernels.engine import requests
from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import EngineConfig, RequestOutput, SamplingParams
from cb_kernels.engine.cuda_graphs import adapter_decode_runner, graphs_enabled
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.scheduler import ScheduledBatch, Scheduler
from cb_kernels.engine.sequence import Sequence, SequenceStatus
from cb_kernels.engine.sizing import ModelShape, resolve
from cb_kernels.engine.streams import StreamOrchestrator
from cb_kernels.engine.swapper import make_swapper
from cb_kernels.ops.sampling import greedy_tokens

logger = logging.getLogger("cb_kernels.engine")


class Engine:
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
                                    pack_weights=config.pack_weights)
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
        (finish_reason "cancelled") comes with the next step()."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not waiting or running (unknown, or "
                             "already finished)")
        self._end(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one batch; returns the RequestOutputs of the requests that ended in it (plus
        those cancelled since the last step)."""
        batch = self.scheduler.schedule()
        for seq in self.scheduler.failed:     # a swap failed: that request alone ends
            self._end(seq, "error", seq.error)
        self.scheduler.failed.clear()
        if not batch.seqs and self.scheduler.has_unfinished():
            # Cannot happen while add_request rejects requests that never fit (see scheduler.py);
            # raising beats spinning forever in generate() if that proof ever breaks.
            raise RuntimeError(f"the scheduler found nothing to run: {self.stats()}")
        if batch.seqs:
            self._steps += 1
            start = time.perf_counter()
            try:
                sampled, tokens = self._run(batch)
                if not isinstance(tokens, list):
                    tokens = tokens.result()
            except Exception as e:  # one bad step fails its requests, never the engine
                self._fail_step(batch, e)
            else:
                if self.swapper is not None and batch.num_prefill_tokens:
                    # The swap-or-recompute choice weighs copies against this measured rate.
                    self.swapper.policy.record_prefill(batch.num_tokens, time.perf_counter() - start)
                self._postprocess(batch, sampled, tokens)
        ended, self._ended = self._ended, []
        return ended

    def _run(self, batch: ScheduledBatch):
        a = self.adapter
        self.streams.begin_compute()
        a.copy_blocks(batch.blocks_to_copy)
        input_ids, position_ids, logits_idx, step, sampled = a.prepare(batch.seqs,
                                                                       batch.num_new_tokens)
        if self.graphs is not None and batch.num_prefill_tokens == 0:
            logits = self.graphs({"input_ids": input_ids[0], "positions": position_ids[0],
                                  "slot_mapping": step.slot_mapping, "seq_lens": step.seq_lens,
                                  "block_tables": step.block_tables,
                                  "cu_seqlens_q": step.cu_seqlens_q})
        else:
            logits = a.forward(input_ids, position_ids, logits_idx, step)
        if sampled and all(seq.params.greedy for seq in sampled):
            # Greedy ids come back on the d2h stream behind an event (on CPU: a plain copy).
            return sampled, self.streams.tokens_to_host(greedy_tokens(logits))
        tokens = self.sampler(logits, sampled) if sampled else []
        return sampled, tokens

    def _postprocess(self, batch: ScheduledBatch, sampled: list, tokens: list) -> None:
        now = time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        for seq, token in zip(sampled, tokens):
            seq.token_ids.append(token)
            m = seq.metrics
            m.token_times.append(now)
            if m.first_token_time is None:
                m.first_token_time = now
            self._num_generated += 1
            reason = seq.check_stop(token)
            if reason is not None:
                self._end(seq, reason)

    def _fail_step(self, batch: ScheduledBatch, error: Exception) -> None:
        self._failed_steps += 1
        message = f"{type(error).__name__}: {error}"
        logger.error("step %d failed; failing its %d requests: %s", self._steps, len(batch.seqs),
                     message)
        self.block_manager.discard_step_hashes()
        for seq in batch.seqs:
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

    # -- batch helpers --------------------------------------------------------------------------
    def _add_all(self, prompts, params) -> list:
        """Add every prompt; a bad one becomes an "error" output instead of stopping the rest.
        Returns one entry per prompt: a request id, or the finished error output."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise TypeError("prompts must be a list of prompts (token-id lists or strings), got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        entries = []
        for prompt, p in zip(prompts, per_prompt):
            try:
                entries.append(self.add_request(prompt, p))
            except (ValueError, TypeError) as e:
                entries.append(requests.error_output(f"req_rejected_{self._next_id}", prompt, e))
                self._next_id += 1
        return entries

    def generate(self, prompts, params=None) -> list:
        """Run `prompts` to completion; returns their RequestOutputs in prompt order. A prompt
        that add_request rejects gets an output with finish_reason "error" and the message."""
        entries = self._add_all(prompts, params)
        wanted = {e for e in entries if isinstance(e, str)}
        done, others = {}, []
        while wanted - done.keys():
            for out in self.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                else:
                    others.append(out)
        self._ended += others     # requests added by add_request() still reach step()'s caller
        return [done[e] if isinstance(e, str) else e for e in entries]

    def stream(self, prompts, params=None) -> Iterator[RequestOutput]:
        """Yield, after each step, one RequestOutput per request that got new tokens, holding
        only those tokens (and their text); the last one of a request has its finish_reason."""
        entries = self._add_all(prompts, params)
        for e in entries:
            if not isinstance(e, str):
                yield e
        live = {e: self._seqs[e] for e in entries if isinstance(e, str)}
        others = []
        while live:
            ended = set()
            for out in self.step():
                (ended.add(out.request_id) if out.request_id in live else others.append(out))
            for rid, seq in list(live.items()):
                new = seq.token_ids[seq.num_prompt_tokens + seq.num_streamed_tokens:]
                if not new and rid not in ended:
                    continue
                seq.num_streamed_tokens += len(new)
                yield self._output(seq, new, self._text_delta(seq))
                if rid in ended:
                    del live[rid]
        self._ended += others

    def _text_delta(self, seq: Sequence) -> Optional[str]:
        """New text since the last delta. Decoding all output tokens and cutting off what was
        sent keeps the spaces and multi-token characters that decoding a delta alone loses."""
        if self.tokenizer is None:
            return None
        full = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        sent, seq.streamed_text = seq.streamed_text, full
        return full[len(sent):] if full.startswith(sent) else full

    # -- introspection --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if any block, ref count or queue is inconsistent."""
        s = self.scheduler
        self.block_manager.check_invariants(s.seqs_holding_blocks())
        for seq in s.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} in running"
            assert self._seqs.get(seq.request_id) is seq, f"{seq} running but unknown"
        for seq in s.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"{seq} waiting"
        if self.swapper is not None:
            self.swapper.check_invariants(s.swapped)
        assert not s.swapped or self.swapper is not None, "swapped requests without a host pool"
        assert len(s.running) + len(s.waiting) + len(s.swapped) == len(self._seqs), \
            "a request is lost"
        assert len(s.running) <= s.max_num_seqs

    def stats(self) -> dict:
        bm, s = self.block_manager, self.scheduler
        return {
            "used_blocks": bm.num_used_blocks, "free_blocks": len(bm.free_ids),
            "cached_blocks": bm.num_cached_blocks, "num_blocks": bm.num_blocks,
            **self._offload_stats(),
            "recomputes": s.num_recomputes, "preemptions": s.num_preemptions,
            "prefix_hit_blocks": bm.num_hit_blocks, "evicted_blocks": bm.num_evicted_blocks,
            "steps": self._steps, "failed_steps": self._failed_steps,
            "running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
            "generated_tokens": self._num_generated,
        }

    def _offload_stats(self) -> dict:
        if self.swapper is None:
            return {"host_used_blocks": 0, "host_total_blocks": 0, "host_occupancy": 0.0,
                    "swaps_out": 0, "swaps_in": 0, "swap_blocks_out": 0, "swap_blocks_in": 0,
                    "swap_bytes": 0, "swap_failures": 0}
        return self.swapper.offload.stats()
