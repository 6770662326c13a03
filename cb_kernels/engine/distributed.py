"""Tensor parallelism of the Engine over torch.distributed: rank 0 drives, the others follow.

Every rank builds the same model and the same `Engine(model, EngineConfig(tensor_parallel_size=
N))`. `setup` checks the sizes (runner/tensor_parallel.check_shardable: numbers in the message)
and the process group (torchrun's environment or one the caller initialised; the world size must
be N), splits the model in place (runner/tensor_parallel.py) and makes the groups: the model's
collectives on gloo (CPU) or NCCL (CUDA), this module's messages on gloo, both with
`EngineConfig.tensor_parallel_timeout_s`.

The step protocol. Rank 0 owns every decision: scheduler, block manager, prefix cache, sampler.
Its runner is a `DriverRunner`: before each execute it broadcasts one small int64 header
(message kind and sizes; on CPU it also carries the first 1024 payload ints) and, when the step
does not fit there, the rest of the int64 payload: the packed step (runner/step_inputs.StepInputs:
input ids after the overlap pipeline filled them, positions, sampled rows, slot mapping, block
tables, lengths, the chunked view) and the step's copy-on-write block pairs. Each other rank
(`serve`) rebuilds the StepInputs around its own KV shard and runs the same forward; the
collectives inside it (all_reduce after o_proj and down_proj, the LM head's gather) keep the
ranks in step. Tokens are picked once: greedy ones by the sharded head's gather (the same on
every rank), sampled ones by rank 0's sampler from the gathered logits; rank 0 alone needs them.
`release(outputs)` ends a session: the workers' `serve` returns those outputs (pickled), so every
rank's `generate` returns the same list.

Failure: any error inside a tensor-parallel step (a rank died: the connection drops; a rank hangs:
the collective times out after tensor_parallel_timeout_s) leaves the ranks out of step, so the
engine is marked broken: that step's requests fail, every later step fails at once, and
`generate` raises TensorParallelError naming the rank and the cause, on every live rank.

What TP switches off (logged once): the host swap pool (preemption is by recompute: a swap would
have to move every rank's blocks in step), CUDA graphs (no collective is captured in them here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import socket
from typing import Iterator, Optional

import torch

from cb_kernels.engine import frontend, sizing
from cb_kernels.runner import tensor_parallel
from cb_kernels.runner.step_inputs import AttentionMetadata, ChunkedView, StepInputs

logger = logging.getLogger("cb_kernels.engine")

STEP, DONE = 1, 2
_HEADER = 16
# On CPU a step's first _INLINE payload ints travel in the header's broadcast: a decode step of
# 16 sequences is one broadcast, not two (each ~80 us on gloo over loopback, 2-core bench host).
_INLINE = 1024


class TensorParallelError(RuntimeError):
    """The ranks of a tensor-parallel engine fell out of step (one died, hung or failed)."""


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def setup(model, config, runner=None) -> Optional["TensorParallel"]:
    """The TensorParallel of this rank, or None when tensor_parallel_size is 1. Raises
    ValueError/RuntimeError (with the numbers) for sizes that cannot split or a missing or
    mismatched process group."""
    n = config.tensor_parallel_size
    if n == 1:
        return None
    if runner is not None:
        raise ValueError(f"tensor_parallel_size={n} builds its own runner; a runner= cannot be "
                         "given with it")
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
    return TensorParallel(rank, n, group, control, config, device)


def building(tp: Optional["TensorParallel"]):
    """Context of the runner's construction: its probes run on each rank alone."""
    return tensor_parallel.local_only() if tp is not None else contextlib.nullcontext()


class TensorParallel:
    """One rank's side of a tensor-parallel Engine (see the module docstring)."""

    def __init__(self, rank: int, size: int, group, control, config, device):
        self.rank, self.size, self.group, self.control = rank, size, group, control
        self.device, self.timeout_s = device, config.tensor_parallel_timeout_s
        self.auto_blocks = config.num_blocks is None
        self.broken: Optional[str] = None
        changes = {}
        if config.cuda_graphs is not False and device.type == "cuda":
            logger.info("cuda_graphs: off under tensor parallelism (collectives are not captured)")
        changes["cuda_graphs"] = False
        changes["cpu_offload_gib"] = 0.0
        if rank == 0:
            logger.info("tensor parallelism: %d ranks, rank 0 drives (no host swap pool: "
                        "preemption by recompute)", size)
        self.config = dataclasses.replace(config, **changes)

    # -- construction ---------------------------------------------------------------------------
    def agree(self, resolved):
        """The resolved config every rank uses: the smallest KV pool any rank can hold. On CPU an
        auto-sized pool is also divided by the ranks on this host: each sized its share of the
        same host memory."""
        num_blocks = resolved.num_blocks
        if self.auto_blocks and self.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
            num_blocks = max(1, num_blocks // max(1, local))
        blocks = torch.tensor([num_blocks], dtype=torch.int64)
        self._collective(torch.distributed.all_reduce, blocks, op=torch.distributed.ReduceOp.MIN,
                         group=self.control)
        if int(blocks) != resolved.num_blocks:
            logger.info("tensor parallelism: num_blocks %d -> %d (the host's memory shared by its "
                        "ranks, the smallest rank's pool)",
                        resolved.num_blocks, int(blocks))
        return sizing.replace(resolved, num_blocks=int(blocks), preemption="recompute",
                              cpu_offload_gib=0.0)

    def wrap(self, runner):
        """Rank 0's runner broadcasts each step; the others keep theirs (serve runs it)."""
        self.local = runner
        return DriverRunner(runner, self) if self.rank == 0 else FollowerRunner(runner, self)

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.size,
                "local_num_kv_heads": self.local.num_kv_heads}

    # -- messages -------------------------------------------------------------------------------
    def _collective(self, fn, *args, **kwargs):
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        try:
            return fn(*args, **kwargs)
        except Exception as e:            # noqa: BLE001 (gloo/NCCL errors: DistBackendError, ...)
            self.fail(e)

    def fail(self, error: BaseException):
        if isinstance(error, TensorParallelError):
            raise error
        self.broken = (f"tensor parallelism: rank {self.rank} of {self.size} lost step with the "
                       f"other ranks (one died, hung past the {self.timeout_s:g} s "
                       f"tensor_parallel_timeout_s, or failed): {type(error).__name__}: {error}")
        logger.error("%s", self.broken)
        raise TensorParallelError(self.broken) from error

    def _inline(self) -> int:
        """Payload ints carried by the header's broadcast (CPU: one group for both)."""
        return _INLINE if self.group is self.control else 0

    def _send(self, kind: int, sizes: list, payload: torch.Tensor, group) -> None:
        inline = self._inline() if kind == STEP else 0
        k = min(payload.numel(), inline)
        header = torch.zeros(_HEADER + inline, dtype=torch.int64)
        header[0], header[1] = kind, payload.numel()
        header[2:2 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        if k:
            header[_HEADER:_HEADER + k] = payload[:k]
        self._collective(torch.distributed.broadcast, header, 0, group=self.control)
        if payload.numel() > k:
            self._collective(torch.distributed.broadcast, payload[k:].contiguous(), 0,
                             group=group)

    def send_step(self, inputs: StepInputs, copies: list, greedy: bool) -> None:
        a = inputs.attn
        parts = [inputs.input_ids, inputs.positions, inputs.logits_indices, a.slot_mapping,
                 a.block_tables.reshape(-1).long(), a.seq_lens.long(), a.cu_seqlens_q.long()]
        chunk = [0, 0]
        if a.chunked is not None:
            c = a.chunked
            chunk = [c.block_tables.shape[0], c.block_tables.shape[1]]
            parts += [c.block_tables.reshape(-1).long(), c.seq_lens.long(), c.cu_seqlens_q.long()]
        flat = [x for pair in copies for x in pair]
        dev = inputs.input_ids.device
        parts.append(torch.tensor(flat, dtype=torch.int64).to(dev))
        payload = torch.cat([p.to(torch.int64) for p in parts])
        sizes = [inputs.input_ids.numel(), inputs.logits_indices.numel(), inputs.num_seqs,
                 a.block_tables.shape[1], len(inputs.sampled), int(greedy), len(copies)] + chunk
        self._send(STEP, sizes, payload, self.group)

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        """Rank 0: end the session; the other ranks' serve() returns `outputs` (or raises
        TensorParallelError(error))."""
        if self.broken is not None:
            return
        data = pickle.dumps((outputs, error))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._send(DONE, [], payload, self.control)

    def serve(self):
        """Ranks other than 0: run rank 0's steps until its release(); returns what it sent."""
        if self.rank == 0:
            raise RuntimeError("serve() runs on the ranks other than 0; rank 0 steps the engine")
        r = self.local
        inline = self._inline()
        while True:
            header = torch.zeros(_HEADER + inline, dtype=torch.int64)
            self._collective(torch.distributed.broadcast, header, 0, group=self.control)
            kind, n = int(header[0]), int(header[1])
            if kind == DONE:
                payload = torch.empty(n, dtype=torch.uint8)
                self._collective(torch.distributed.broadcast, payload, 0, group=self.control)
                outputs, error = pickle.loads(payload.numpy().tobytes())
                if error is not None:
                    raise TensorParallelError(f"rank 0 failed: {error}")
                return outputs
            if kind != STEP:
                self.fail(RuntimeError(f"unknown message kind {kind} from rank 0"))
            k = min(n, inline)
            payload = header[_HEADER:_HEADER + k]
            if n > k:
                rest = torch.empty(n - k, dtype=torch.int64, device=self.device)
                self._collective(torch.distributed.broadcast, rest, 0, group=self.group)
                payload = torch.cat([payload.to(self.device), rest]) if k else rest
            try:
                inputs, greedy, copies = self._unpack(header[2:_HEADER].tolist(), payload, r)
                if copies:
                    r.copy_blocks(copies)
                r.execute(inputs, greedy)
            except Exception as e:        # noqa: BLE001
                self.fail(e)

    @staticmethod
    def _unpack(sizes: list, payload: torch.Tensor, r):
        num_tokens, num_logits, num_seqs, width, num_sampled, greedy, num_copies, pieces, \
            piece_width = sizes[:9]
        lengths = [num_tokens, num_tokens, num_logits, num_tokens, num_seqs * width, num_seqs,
                   num_seqs + 1]
        if pieces:
            lengths += [pieces * piece_width, pieces, pieces + 1]
        lengths.append(2 * num_copies)
        parts = list(payload.split(lengths))
        ids, pos, logits_idx, slots, tables, lens, cu = parts[:7]
        chunked = None
        if pieces:
            t, cl, ccu = parts[7:10]
            chunked = ChunkedView(t.int().view(pieces, piece_width), cl.int(), ccu.int())
        flat = parts[-1].tolist() if num_copies else []     # (a device sync on CUDA)
        copies = list(zip(flat[0::2], flat[1::2]))
        attn = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.int().view(num_seqs, width),
            seq_lens=lens.int(), cu_seqlens_q=cu.int(), layout=r.layout, chunked=chunked)
        return StepInputs(ids, pos, logits_idx, attn, [None] * num_sampled, num_seqs), \
            bool(greedy), copies

    # -- the front end on every rank ------------------------------------------------------------
    def generate(self, engine, prompts, params) -> list:
        if self.rank != 0:
            return self.serve()
        try:
            outputs = frontend.generate(engine, prompts, params)
        except BaseException as e:
            self.release(None, f"{type(e).__name__}: {e}")
            raise
        self.release(outputs)
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        return outputs

    def stream(self, engine, prompts, params) -> Iterator:
        """Rank 0: frontend.stream. The other ranks yield, once rank 0's stream ends, one
        output per request with all its tokens (the deltas joined; outputs[0] only)."""
        if self.rank != 0:
            yield from self.serve()
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
        if self.broken is not None:
            raise TensorParallelError(self.broken)


class DriverRunner:
    """Rank 0's runner: the local one, broadcasting each step to the other ranks first."""

    def __init__(self, runner, tp: TensorParallel):
        self.local, self.tp = runner, tp
        self._copies: list = []

    def __getattr__(self, name):
        return getattr(self.local, name)

    def allocate_cache(self, *args) -> None:
        self.local.allocate_cache(*args)

    def copy_blocks(self, pairs: list) -> None:
        self.local.copy_blocks(pairs)
        self._copies = list(pairs)

    def prepare(self, seqs: list, num_new_tokens: list) -> StepInputs:
        return self.local.prepare(seqs, num_new_tokens)

    def execute(self, inputs: StepInputs, greedy: bool = False):
        copies, self._copies = self._copies, []
        self.tp.send_step(inputs, copies, greedy)
        try:
            return self.local.execute(inputs, greedy)
        except TensorParallelError:
            raise
        except Exception as e:            # noqa: BLE001 (the others wait in a collective now)
            self.tp.fail(e)

    def refresh_weights(self) -> None:
        self.local.refresh_weights()


class FollowerRunner(DriverRunner):
    """The runner the Engine of a rank other than 0 holds: its steps come from rank 0 (serve
    runs the local runner); a step of its own would break the lockstep, so it is refused."""

    def copy_blocks(self, pairs: list) -> None:
        self.execute(None)

    def execute(self, inputs, greedy: bool = False):
        raise RuntimeError(f"rank {self.tp.rank} of a tensor-parallel engine runs rank 0's steps: "
                           "call generate() or stream() on every rank (or engine.tp.serve() "
                           "while rank 0 steps), not add_request()/step() here")


# -- starting the ranks on one machine ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, timeout_s: float, threads: int, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    fn(rank, *args)
    # Leave together, with no engine (whose groups sit in reference cycles) left for the
    # interpreter's teardown: gloo objects freed that late can abort the process.
    import gc

    torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()


def spawn(fn, size: int, args: tuple = (), timeout_s: float = 300.0) -> None:
    """Run fn(rank, *args) in `size` new processes on this machine (torch.multiprocessing), each
    with a gloo process group of `size` ranks and 1/size of the CPU threads; returns when all end,
    raises if one fails (torch.multiprocessing.ProcessRaisedException names the rank)."""
    import torch.multiprocessing as mp

    threads = max(1, torch.get_num_threads() // size)
    mp.start_processes(_rank_main, args=(size, free_port(), timeout_s, threads, fn, args),
                       nprocs=size, join=True, start_method="spawn")
