"""Tensor parallelism, the engine's side: the process group, this rank's runner built over it,
the agreed config, and the front end on every rank. The split model and the runners that keep
the ranks in step live below the engine (runner/tensor_parallel/); starting the processes lives in
engine/launcher.py.

Two ways in, the same on every rank (each builds the same model):

    engine = Engine(model, EngineConfig(tensor_parallel_size=N))          # the short path
    runner = build_runner(model, config)                                  # or: the runner first
    engine = Engine(model, config, runner=runner)

`build_runner` checks the sizes (tensor_parallel.check_shardable: numbers in the message) and the
process group (torchrun's environment or one the caller initialised; the world size must be N),
selects this rank's GPU (cuda:LOCAL_RANK) before any collective, splits the model in place, makes
the groups (the model's collectives on gloo (CPU) or NCCL (CUDA), the step channel's headers on
gloo, both with `EngineConfig.tensor_parallel_timeout_s`) and returns rank 0's DriverRunner or
another rank's FollowerRunner (runner/tensor_parallel/runners.py). The Engine adopts it through
`TensorParallel`, which only checks it against the config and the model, switches off what TP
does not run, and agrees the KV pool size over the process group.

Rank 0 owns every decision: scheduler, block manager, prefix cache, sampler. `generate` and
`stream` run on rank 0 while the other ranks' runners serve its steps; rank 0 then ends the
session with the outputs, so every rank's `generate` returns the same list.

Failure: any error inside a tensor-parallel step breaks the channel: that step's requests fail,
every later step fails at once, and `generate` raises TensorParallelError naming the rank and the
cause, on every live rank.

The RL calls (README, "Tensor parallelism"): sleep, wake_up, reset_prefix_cache,
weights_updated and update_weights run on rank 0 and reach the others as CONTROL messages beside
the steps (`everywhere`); the other ranks run them inside follow() or inside their own call of
the same method. An error rank 0 raises before sending (a bad argument, requests in flight) is
sent as a refusal (`refusing`), so a rank waiting in the same call raises it too. Each of rank
0's steps carries its weight_version; before running one, a follower checks its own shard's
weights (`follow_weights`: trainer writes to any rank's shard are computed with on that rank).

What TP switches off (logged once): the host swap pool (preemption is by recompute: a swap would
have to move every rank's blocks in step), CUDA graphs (no collective is captured in them here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import weakref
from typing import Iterator, Optional

import torch

from cb_kernels.engine import frontend, rl, sizing
from cb_kernels.runner import TransformersRunner, tensor_parallel
from cb_kernels.runner.base import TensorParallelRunner
from cb_kernels.runner.tensor_parallel import StepChannel, TensorParallelError
from cb_kernels.runner.tensor_parallel.runners import REFUSED

logger = logging.getLogger("cb_kernels.engine")

__all__ = ["build_runner", "setup", "adopt", "select_device", "TensorParallel",
           "TensorParallelError", "generate", "stream", "attach", "everywhere", "refusing",
           "update_weights", "follow_weights"]


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def select_device(device: torch.device) -> torch.device:
    """This rank's GPU: cuda:LOCAL_RANK (torch.cuda.set_device, before the model moves or NCCL
    starts), so the ranks of one host never share GPU 0. `device` elsewhere as given."""
    if device.type != "cuda" or "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        return device
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _check_config(model, config) -> None:
    """What tensor parallelism refuses before anything splits (ValueError/TypeError)."""
    n = config.tensor_parallel_size
    if n == 1:
        raise ValueError("tensor parallelism needs EngineConfig(tensor_parallel_size=N) with "
                         "N > 1 (the number of ranks, the same config on every rank), got 1")
    if not hasattr(model, "config") or not callable(getattr(model, "get_output_embeddings",
                                                            None)):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if config.preemption == "swap" or (config.cpu_offload_gib or 0) > 0:
        raise ValueError(f"tensor_parallel_size={n} preempts by recompute only (a swap would "
                         "have to move every rank's KV blocks in step): use preemption='auto' or "
                         "'recompute' and no cpu_offload_gib")


def setup(model, config) -> StepChannel:
    """This rank's StepChannel over a process group of tensor_parallel_size ranks, with the model
    split in place for this rank. Raises ValueError/RuntimeError (with the numbers) for sizes that
    cannot split or a missing or mismatched process group."""
    _check_config(model, config)
    n = config.tensor_parallel_size
    tensor_parallel.check_shardable(model, n)
    dist = torch.distributed
    if not dist.is_available():
        raise RuntimeError(f"tensor_parallel_size={n} needs torch.distributed, which this torch "
                           "build lacks")
    timeout = datetime.timedelta(seconds=config.tensor_parallel_timeout_s)
    device = next(model.parameters()).device
    if device.type == "cuda":
        wanted = select_device(device)
        if device != wanted and device.index is not None:
            raise ValueError(f"tensor parallelism: this rank (LOCAL_RANK={wanted.index}) holds "
                             f"its model on {device}; move it to {wanted} (each rank its own "
                             "GPU)")
    if not dist.is_initialized():
        if not _torchrun_env():
            raise RuntimeError(
                f"tensor_parallel_size={n} needs one process per rank, and this process has no "
                "torch.distributed process group (and no torchrun environment to make one): run "
                f"it under `torchrun --nproc-per-node {n} ...`, call "
                "torch.distributed.init_process_group first, or use `cb-kernels generate "
                f"--tensor-parallel-size {n}`, which starts the {n} processes itself")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    world = dist.get_world_size()
    if world != n:
        raise ValueError(f"tensor_parallel_size={n}, but the torch.distributed world has {world} "
                         f"processes: run {n} ranks (torchrun --nproc-per-node {n}), one Engine "
                         "on each")
    rank = dist.get_rank()
    if device.type == "cuda":
        group = dist.new_group(backend="nccl", timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
    else:
        group = control = dist.new_group(backend="gloo", timeout=timeout)
    tensor_parallel.shard_model(model, rank, n, group)
    return StepChannel(rank, n, group, control, device, config.tensor_parallel_timeout_s)


def build_runner(model, config):
    """This rank's tensor-parallel runner over `model` (split in place here): a DriverRunner on
    rank 0, a FollowerRunner on the others. Call it on every rank with the same model and config
    (EngineConfig(tensor_parallel_size=N), N > 1), then `Engine(model, config, runner=runner)` on
    every rank. Raises as `setup` does."""
    channel = setup(model, config)
    with tensor_parallel.local_only():        # the runner's probes run on each rank alone
        local = TransformersRunner(
            model, attention_backend=config.attention_backend, pack_weights=config.pack_weights,
            greedy_head=config.greedy_head, cuda_graphs=False,
            available_host_bytes=sizing.host_available_bytes()
            if config.pack_weights == "auto" else None)
    return tensor_parallel.make_runner(local, channel)


def adopt(model, config, runner) -> Optional["TensorParallel"]:
    """The engine's TensorParallel for `runner`, or None for a runner of one process (then
    tensor_parallel_size must be 1). Raises ValueError naming the mismatch."""
    if isinstance(runner, TensorParallelRunner):
        return TensorParallel(model, config, runner)
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs a "
                         f"tensor-parallel runner, got a {type(runner).__name__}: pass no "
                         "runner= (the Engine builds it) or runner=build_runner(model, config) "
                         "(cb_kernels.engine.distributed), on every rank")
    return None


class TensorParallel:
    """The engine's side of a tensor-parallel runner: the runner checked against the config, the
    model and the process group; the config with what TP switches off; the agreed pool size."""

    def __init__(self, model, config, runner):
        n, where = runner.world_size, f"rank {runner.rank} of {runner.world_size}"
        if config.tensor_parallel_size != n:
            raise ValueError(f"EngineConfig(tensor_parallel_size={config.tensor_parallel_size}), "
                             f"but the runner is {where}: pass every rank the config its runner "
                             "was built with")
        _check_config(model, config)
        dist, group = torch.distributed, runner.channel.control
        if dist.is_available() and dist.is_initialized() and \
                (dist.get_world_size(group), dist.get_rank(group)) != (n, runner.rank):
            raise ValueError(f"the runner is {where} ({type(runner).__name__}), but this process "
                             f"is rank {dist.get_rank(group)} of {dist.get_world_size(group)}: "
                             "build each rank's runner on that rank (build_runner(model, config))")
        info = tensor_parallel.info_of(model)
        if info is None or (info.rank, info.size) != (runner.rank, n):
            split = "not split" if info is None else f"split as rank {info.rank} of {info.size}"
            raise ValueError(f"the model is {split}, but the runner is {where}: pass the model "
                             "the runner was built from (build_runner(model, config) splits it)")
        self.channel, self.rank, self.size = runner.channel, runner.rank, n
        self.auto_blocks = config.num_blocks is None
        if config.cuda_graphs is not False and self.channel.device.type == "cuda":
            logger.info("cuda_graphs: off under tensor parallelism (collectives are not captured)")
        if self.rank == 0:
            logger.info("tensor parallelism: %d ranks, rank 0 drives (no host swap pool: "
                        "preemption by recompute)", self.size)
        self.config = dataclasses.replace(config, cuda_graphs=False, cpu_offload_gib=0.0)

    def agree(self, resolved):
        """The resolved config every rank uses: the smallest KV pool any rank can hold. On CPU an
        auto-sized pool is also divided by the ranks on this host: each sized its share of the
        same host memory."""
        num_blocks = resolved.num_blocks
        if self.auto_blocks and self.channel.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
            num_blocks = max(1, num_blocks // max(1, local))
        blocks = torch.tensor([num_blocks], dtype=torch.int64)
        self.channel.collective(torch.distributed.all_reduce, blocks,
                                op=torch.distributed.ReduceOp.MIN, group=self.channel.control)
        if int(blocks) != resolved.num_blocks:
            logger.info("tensor parallelism: num_blocks %d -> %d (the host's memory shared by its "
                        "ranks, the smallest rank's pool)",
                        resolved.num_blocks, int(blocks))
        return sizing.replace(resolved, num_blocks=int(blocks), preemption="recompute",
                              cpu_offload_gib=0.0)


# -- the front end on every rank (Engine.generate / Engine.stream with a tensor-parallel runner) --
def generate(engine, prompts, params) -> list:
    """Rank 0: frontend.generate, then the session ends with its outputs; the other ranks serve
    rank 0's steps and return those outputs."""
    runner = engine.runner
    if runner.rank != 0:
        return runner.serve()
    try:
        outputs = frontend.generate(engine, prompts, params)
    except BaseException as e:
        runner.release(None, f"{type(e).__name__}: {e}")
        raise
    runner.release(outputs)
    return outputs


def stream(engine, prompts, params) -> Iterator:
    """Rank 0: frontend.stream. The other ranks yield, once rank 0's stream ends, one output
    per request with all its tokens (the deltas joined; outputs[0] only)."""
    runner = engine.runner
    if runner.rank != 0:
        yield from runner.serve()
        return
    tokens, texts, finished = {}, {}, []
    try:
        for out in frontend.stream(engine, prompts, params):
            key = (out.request_id, out.outputs[0].index)
            tokens.setdefault(key, []).extend(out.token_ids)
            texts[key] = texts.get(key, "") + (out.text or "")
            if out.finished:
                finished.append(dataclasses.replace(
                    out, token_ids=tokens[key], text=texts[key] if out.text is not None
                    else None, outputs=[]))
            yield out
    except GeneratorExit:            # the caller stopped reading: the session ends here
        with contextlib.suppress(TensorParallelError):
            runner.release(finished)
        raise
    except BaseException as e:
        runner.release(finished, f"{type(e).__name__}: {e}")
        raise
    runner.release(finished)


# -- the RL calls on every rank (Engine.sleep, wake_up, update_weights, reset_prefix_cache,
#    weights_updated with a tensor-parallel runner; README, "RL") ---------------------------------
def attach(engine) -> None:
    """A follower's runner wired to its engine: rank 0's RL calls run here (`on_control`), and
    before each of rank 0's steps this rank checks its own shard's weights (`before_step`)."""
    if engine.tp is None or engine.rank == 0:
        return
    ref = weakref.ref(engine)
    engine.runner.on_control = lambda op, args: _run(ref(), op, args)
    engine.runner.before_step = lambda version: follow_weights(ref(), version)


def follow_weights(engine, version: int) -> None:
    """A follower, before each of rank 0's steps: this rank's shard checked as rank 0 checks its
    own (Engine.check_weights: the runner's copies rebuilt after a submodule replacement or an
    optimizer step, its own version checks otherwise), then rank 0's weight_version adopted, so
    every rank reports the same one."""
    engine.check_weights()
    engine.weight_version = engine.frontend.weight_version = version


@contextlib.contextmanager
def refusing(engine, op: str):
    """Rank 0: an error raised inside (a bad argument, requests in flight) is sent to the other
    ranks before it propagates, so a rank waiting in the same call raises it too, instead of
    waiting forever; a rank serving steps (follow()) ignores it. Nothing else is sent."""
    try:
        yield
    except Exception as e:
        if engine.tp is not None and engine.rank == 0 and not isinstance(e, TensorParallelError):
            with contextlib.suppress(TensorParallelError):
                engine.runner.send_control(REFUSED, {"op": op, "type": type(e).__name__,
                                                     "message": str(e)})
        raise


def everywhere(engine, op: str, **args):
    """Engine call `op` (engine._<op>_here(**args)) on this rank and, under tensor parallelism
    from rank 0, on every other rank: sent first, then run here. The other ranks run it in
    follow() or in their own call of the same method (serve(until=op) returns its result)."""
    if engine.tp is not None:
        if engine.rank != 0:
            return engine.runner.serve(until=op)
        engine.runner.send_control(op, args)
    return _run(engine, op, args)


def _run(engine, op: str, args: dict, tensors=None):
    """Every rank: the local half of `op`, then what joins the ranks (sleep: the bytes)."""
    if op == "update_weights":
        return _load_shards(engine, args["meta"], tensors)
    if op not in ("sleep", "wake_up", "reset_prefix_cache", "weights_updated"):
        raise RuntimeError(f"unknown engine call {op!r} from rank 0")
    result = getattr(engine, f"_{op}_here")(**args)
    if op == "sleep":
        per_rank = [result]
        if engine.tp is not None:
            mine = torch.tensor([result], dtype=torch.int64)
            parts = [torch.zeros(1, dtype=torch.int64) for _ in range(engine.tp.size)]
            engine.tp.channel.collective(torch.distributed.all_gather, parts, mine,
                                         group=engine.tp.channel.control)
            per_rank = [int(p) for p in parts]
        engine.sleep_freed_bytes = per_rank
        return sum(per_rank)
    return result


def update_weights(engine, named_tensors) -> int:
    """Rank 0: every (name, full tensor) pair checked against the unsplit shapes (nothing is
    sent when one is bad: every rank stays as it was), then the names, dtypes and shapes sent,
    each tensor broadcast (gloo, as bytes), and every rank writes its own part (sharding's
    split of that name: rows, columns, the whole, a tied pair's one Parameter). The other
    ranks' calls (or follow()) take rank 0's tensors; what they pass is not read. Returns the
    new weight_version (the same on every rank)."""
    runner = engine.runner
    if engine.rank != 0:
        return runner.serve(until="update_weights")
    model = engine.model
    with refusing(engine, "update_weights"):
        pairs = rl.check_named(model, named_tensors, lambda name, p: tensor_parallel.full_shape(
            model, name, tuple(p.shape)))
    meta = [(name, t.dtype, tuple(t.shape)) for name, _, t in pairs]
    runner.send_control("update_weights", {"meta": meta})
    return _load_shards(engine, meta, [t for _, _, t in pairs])


def _load_shards(engine, meta: list, tensors) -> int:
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    channel = engine.runner.channel
    with torch.no_grad():
        for i, (name, dtype, shape) in enumerate(meta):
            full = channel.broadcast_tensor(None if tensors is None else tensors[i], dtype, shape)
            params[name].copy_(tensor_parallel.shard_of(engine.model, name, full))
    return engine._weights_updated_here()
