"""Tensor parallelism, the engine's side: the process group, the agreed config, and the front end
on every rank. The split model and the runners that keep the ranks in step live below the engine
(runner/tensor_parallel/); starting the processes lives in engine/launcher.py.

Every rank builds the same model and the same `Engine(model, EngineConfig(tensor_parallel_size=
N))`. `setup` checks the sizes (tensor_parallel.check_shardable: numbers in the message) and the
process group (torchrun's environment or one the caller initialised; the world size must be N),
selects this rank's GPU (cuda:LOCAL_RANK) before any collective, splits the model in place and
makes the groups: the model's collectives on gloo (CPU) or NCCL (CUDA), the step channel's
headers on gloo, both with `EngineConfig.tensor_parallel_timeout_s`.

Rank 0 owns every decision: scheduler, block manager, prefix cache, sampler; its runner is a
DriverRunner, the others' a FollowerRunner (runner/tensor_parallel/runners.py). `generate` and
`stream` run on rank 0 while the other ranks follow; rank 0 then ends the session with the
outputs, so every rank's `generate` returns the same list.

Failure: any error inside a tensor-parallel step breaks the channel: that step's requests fail,
every later step fails at once, and `generate` raises TensorParallelError naming the rank and the
cause, on every live rank.

What TP switches off (logged once): the host swap pool (preemption is by recompute: a swap would
have to move every rank's blocks in step), CUDA graphs (no collective is captured in them here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from typing import Iterator, Optional

import torch

from cb_kernels.engine import frontend, sizing
from cb_kernels.runner import tensor_parallel
from cb_kernels.runner.tensor_parallel import StepChannel, TensorParallelError

logger = logging.getLogger("cb_kernels.engine")

__all__ = ["setup", "building", "select_device", "TensorParallel", "TensorParallelError"]


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


def setup(model, config, runner=None) -> Optional["TensorParallel"]:
    """The TensorParallel of this rank, or None when tensor_parallel_size is 1. Raises
    ValueError/RuntimeError (with the numbers) for sizes that cannot split or a missing or
    mismatched process group."""
    n = config.tensor_parallel_size
    if n == 1:
        return None
    if runner is not None:
        raise ValueError(f"tensor_parallel_size={n} builds its own runner (a DriverRunner or "
                         "FollowerRunner over this rank's shard); a runner= cannot be given with "
                         "it")
    if not hasattr(model, "config") or not callable(getattr(model, "get_output_embeddings",
                                                            None)):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if config.preemption == "swap" or (config.cpu_offload_gib or 0) > 0:
        raise ValueError(f"tensor_parallel_size={n} preempts by recompute only (a swap would "
                         "have to move every rank's KV blocks in step): use preemption='auto' or "
                         "'recompute' and no cpu_offload_gib")
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
    channel = StepChannel(rank, n, group, control, device, config.tensor_parallel_timeout_s)
    return TensorParallel(channel, config)


def building(tp: Optional["TensorParallel"]):
    """Context of the runner's construction: its probes run on each rank alone."""
    return tensor_parallel.local_only() if tp is not None else contextlib.nullcontext()


class TensorParallel:
    """One rank's side of a tensor-parallel Engine (see the module docstring)."""

    def __init__(self, channel: StepChannel, config):
        self.channel, self.rank, self.size = channel, channel.rank, channel.size
        self.auto_blocks = config.num_blocks is None
        changes = {}
        if config.cuda_graphs is not False and channel.device.type == "cuda":
            logger.info("cuda_graphs: off under tensor parallelism (collectives are not captured)")
        changes["cuda_graphs"] = False
        changes["cpu_offload_gib"] = 0.0
        if self.rank == 0:
            logger.info("tensor parallelism: %d ranks, rank 0 drives (no host swap pool: "
                        "preemption by recompute)", self.size)
        self.config = dataclasses.replace(config, **changes)
        self.follower = None        # this rank's FollowerRunner (ranks other than 0)

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

    def runner(self, local):
        """This rank's runner around its local one (runner/tensor_parallel/runners.py)."""
        runner = tensor_parallel.make_runner(local, self.channel)
        if self.rank != 0:
            self.follower = runner
        return runner

    def follow(self):
        """Ranks other than 0: run rank 0's steps until it ends the session; returns what it
        sent (rank 0's outputs)."""
        if self.follower is None:
            raise RuntimeError("follow() runs on the ranks other than 0; rank 0 steps the engine")
        return self.follower.serve()

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        """Rank 0: end the session; the other ranks' follow() returns `outputs`."""
        self.channel.release(outputs, error)

    def check(self) -> None:
        if self.channel.broken is not None:
            raise TensorParallelError(self.channel.broken)

    # -- the front end on every rank ------------------------------------------------------------
    def generate(self, engine, prompts, params) -> list:
        if self.rank != 0:
            return self.follow()
        try:
            outputs = frontend.generate(engine, prompts, params)
        except BaseException as e:
            self.release(None, f"{type(e).__name__}: {e}")
            raise
        self.release(outputs)
        self.check()
        return outputs

    def stream(self, engine, prompts, params) -> Iterator:
        """Rank 0: frontend.stream. The other ranks yield, once rank 0's stream ends, one output
        per request with all its tokens (the deltas joined; outputs[0] only)."""
        if self.rank != 0:
            yield from self.follow()
            return
        tokens, texts, finished, error = {}, {}, [], None
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
            raise
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.release(finished, error)
        self.check()
