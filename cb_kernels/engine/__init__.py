"""The continuous-batching engine (pure-Python state machines; the torch work goes through
cb_kernels.ops and cb_kernels.hf.adapter).

    config.py         EngineConfig, SamplingParams, RequestOutput, RequestMetrics (checked values)
    sizing.py         resolves the auto (None) config fields from memory, logs each choice
    sequence.py       Sequence: one request's tokens, computed count and block table
    block_manager.py  BlockManager: ref counts, prefix cache (hash chain, LRU), copy-on-write
    scheduler.py      Scheduler: token budget, decode-first order, admission, preemption
    sampler.py        Sampler: greedy / temperature / top-k / top-p, per-request seeds
    requests.py       the checks a request passes before it is queued
    engine.py         Engine: add_request / step (schedule -> run -> postprocess) / cancel
    pipeline.py       overlapped steps: step N+1 launched before step N's tokens reach the host
    frontend.py       Engine's generate / stream / check_invariants / stats
"""
from cb_kernels.engine.config import EngineConfig, RequestMetrics, RequestOutput, SamplingParams
from cb_kernels.engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics"]
