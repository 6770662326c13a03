"""The continuous-batching engine: requests in, tokens out. No model code: the model runs behind
the ModelRunner protocol (cb_kernels/runner), the kernels behind cb_kernels.ops.

    config.py         EngineConfig, SamplingParams, RequestOutput, RequestMetrics (checked values)
    sizing.py         resolves the auto (None) config fields from memory, logs each choice
    sequence.py       Sequence: one request's tokens, computed count and block table
    block_manager.py  BlockManager: ref counts, prefix cache (hash chain, LRU), copy-on-write
    scheduler.py      Scheduler: token budget, decode-first order, admission, preemption
    sampler.py        Sampler: penalties, bias, temperature, min-p/top-k/top-p, logprobs, batched
    structured.py     StructuredOutput (JSON schema, json_object, regex, choice); Grammars: the
                      llguidance grammars, their cache and the batched token masks
    detokenizer.py    IncrementalDetokenizer: output text as tokens arrive, stop strings
    requests.py       the checks a request passes before it is queued; its RequestOutput
    engine.py         Engine: the facade (add_request, cancel, step, generate/stream, stats)
    table.py          RequestTable: live sequences, n > 1 groups, outputs not yet returned, ids
    step_loop.py      StepLoop: schedule -> launch -> resolve; overlap decides when resolve runs
    placeholders.py   overlap: the input ids of step N+1 filled on the device from step N
    step.py           LaunchedStep (a step issued to the device), StepClock (where time goes)
    frontend.py       generate / stream over many prompts; Frontend: a request's stream deltas
    streams.py        StreamOrchestrator: compute and copy streams, token copies to the host
    memory.py         host memory and cgroup limits (psutil or /proc)
    offload.py        OffloadManager: the host pool and block swaps
    preemption.py     swap or recompute: the policy
    swapper.py        Swapper: the scheduler's view of offload
    distributed.py    tensor parallelism, the engine's side: process group, build_runner (this
                      rank's runner), the runner checked and the config agreed
    launcher.py       spawn: the ranks of a tensor-parallel run on one machine
"""
from cb_kernels.engine.config import (CompletionOutput, EngineConfig, RequestMetrics, RequestOutput,
                                      SamplingParams)
from cb_kernels.engine.engine import Engine
from cb_kernels.engine.structured import StructuredOutput

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics",
           "CompletionOutput", "StructuredOutput"]
