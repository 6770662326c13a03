"""The parts of Engine built on its core (add_request / step / cancel): generate and stream over
many prompts, and the introspection (check_invariants, stats)."""
from __future__ import annotations

from typing import Iterator, Optional

from cb_kernels.engine import requests
from cb_kernels.engine.config import RequestOutput
from cb_kernels.engine.sequence import Sequence, SequenceStatus


class EngineFrontend:
    """Mixed into Engine; uses its request API, queues and counters."""

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
        for seq in self._seqs.values():
            assert not seq.has_placeholder, f"{seq} keeps a placeholder between steps"
        if self._in_flight is not None:
            assert self._in_flight.pending, "a step in flight with no tokens to wait for"
            for seq in self._in_flight.batch.seqs:
                assert not self._live(seq) or seq.status is SequenceStatus.RUNNING, \
                    f"{seq} in flight but not running"

    def stats(self) -> dict:
        """Counters and gauges. Of the overlap (pipeline.py): overlapped_steps (launched before
        the previous step's tokens were read), placeholder_fills (input ids filled on the device),
        discarded_tokens (sampled for a request that had ended meanwhile: cancelled, or stopped in
        the step before), host_wait_s, and with clock.device_events on CUDA device_busy_s,
        device_idle_s, timed_steps (StepClock). greedy_head_steps: steps whose tokens came from
        the greedy head (EngineConfig.greedy_head)."""
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
            "overlapped_steps": self._overlapped_steps, "placeholder_fills": self._num_filled,
            "discarded_tokens": self._num_discarded, "greedy_head_steps": self._greedy_head_steps,
            **self.clock.stats(),
        }

    def _offload_stats(self) -> dict:
        if self.swapper is None:
            return {"host_used_blocks": 0, "host_total_blocks": 0, "host_occupancy": 0.0,
                    "swaps_out": 0, "swaps_in": 0, "swap_blocks_out": 0, "swap_blocks_in": 0,
                    "swap_bytes": 0, "swap_failures": 0}
        return self.swapper.offload.stats()
