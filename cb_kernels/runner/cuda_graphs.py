"""CUDA graphs for decode steps: one capture per bucketed batch size, replayed as KV lengths grow.

A decode step of a small model is dozens of kernel launches of a few microseconds each; launching
them from Python costs more than running them. A CUDA graph replays the whole step with one launch.
The graph bakes in tensor addresses and shapes, so inputs live in static buffers sized for a bucket
(batch sizes 1, 2, 4, 8, 16, 32, ...): a batch of n is copied into the smallest bucket >= n and the
rest padded with rows that do no harm (slot -1 writes nothing; KV length 1 reads one key). Only the
values change between replays (KV lengths, block tables), which is why the attention launch must
not read them on the host. Batches larger than the largest bucket run eagerly.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch

from cb_kernels.runner.step_inputs import AttentionMetadata

logger = logging.getLogger("cb_kernels")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def check_cuda_graphs(cuda_graphs) -> str:
    if cuda_graphs != "auto" and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
    return cuda_graphs


def graphs_enabled(cuda_graphs, device) -> bool:
    """'auto' and True capture on CUDA; on other devices both run eagerly (True logs why)."""
    check_cuda_graphs(cuda_graphs)
    on_cuda = torch.device(device).type == "cuda"
    if cuda_graphs is True and not on_cuda:
        logger.info("cuda_graphs=True on %s: no CUDA device, decode steps run eagerly", device)
    return bool(cuda_graphs) and on_cuda


class DecodeGraphRunner:
    """Runs `fn(**inputs) -> Tensor [num_seqs, ...]` for decode batches through captured graphs.

    Parameters
    ----------
    fn : callable
        The decode step. It must only launch device work (no `.item()`, `.tolist()` or other host
        reads of its inputs) so that a replay with new values is correct.
    pad_values : dict
        Every input name -> the value of a padding row. Inputs have the batch as dim 0, e.g.
        ``input_ids [num_seqs]: 0``, ``positions [num_seqs]: 0``, ``slot_mapping [num_seqs]: -1``,
        ``seq_lens [num_seqs]: 1``, ``block_tables [num_seqs, max_blocks_per_seq]: 0``.
    max_shapes : dict
        Input name -> trailing shape of its static buffer (e.g. block_tables: (max_blocks_per_seq,));
        inputs with no entry are 1-D. A narrower input fills the leading columns, the rest pads.
    cumulative : sequence of str
        Inputs of length num_seqs + 1 that count tokens (``cu_seqlens_q``): padding rows continue
        them one token at a time.
    buckets : sequence of int
        Batch sizes to capture, lazily on first use.
    capture : bool
        False runs the same padded static-buffer path eagerly (no graph): for CPU tests of the
        padding logic and for debugging.
    """

    def __init__(self, fn: Callable, pad_values: Mapping[str, int], *,
                 max_shapes: Mapping[str, Sequence[int]] | None = None,
                 cumulative: Sequence[str] = (), buckets: Sequence[int] = DEFAULT_BUCKETS,
                 capture: bool = True, device=None):
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        self.fn = fn
        self.pad_values = dict(pad_values)
        self.max_shapes = {k: tuple(v) for k, v in (max_shapes or {}).items()}
        self.cumulative = set(cumulative)
        self.buckets = sorted(set(buckets))
        self.capture = capture
        self.device = torch.device(device) if device is not None else None
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, object] = {}
        self._pool = None
        self.replays = 0
        self.eager_runs = 0
        self.disabled = ""      # why capture failed; every later call then runs eagerly

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The first num_seqs rows of the step's output: a view into a static buffer that the next
        call overwrites, so read (sample from) it before calling again."""
        missing = set(self.pad_values) - set(inputs)
        if missing:
            raise ValueError(f"inputs lacks {sorted(missing)}")
        num_seqs = self._num_seqs(inputs)
        bucket = self.bucket_for(num_seqs)
        if bucket is None or self.disabled:
            self.eager_runs += 1
            return self.fn(**inputs)
        if bucket not in self._static:
            self._static[bucket] = self._new_static(bucket, inputs)
        static = self._static[bucket]
        self._fill(static, inputs, num_seqs, bucket)
        if not self.capture:
            self.eager_runs += 1
            return self.fn(**static)[:num_seqs]
        if bucket not in self._graphs:
            try:
                self._capture(bucket, static)
            except Exception as e:  # a host sync or an uncapturable op inside fn
                self.disabled = f"{type(e).__name__}: {e}"
                logger.warning("CUDA graph capture of decode batch %d failed (%s); decode steps "
                               "run eagerly from now on", bucket, self.disabled)
                torch.cuda.synchronize()
                self.eager_runs += 1
                return self.fn(**inputs)
        self._graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket][:num_seqs]

    def _num_seqs(self, inputs) -> int:
        name = next(k for k in self.pad_values if k not in self.cumulative)
        return inputs[name].shape[0]

    def _new_static(self, bucket: int, inputs) -> dict[str, torch.Tensor]:
        static = {}
        for name in self.pad_values:
            t = inputs[name]
            rows = bucket + 1 if name in self.cumulative else bucket
            trailing = self.max_shapes.get(name, tuple(t.shape[1:]))
            static[name] = torch.full((rows, *trailing), self.pad_values[name], dtype=t.dtype,
                                      device=t.device)
        return static

    def _fill(self, static, inputs, num_seqs: int, bucket: int) -> None:
        for name, buf in static.items():
            t = inputs[name]
            if name in self.cumulative:
                buf[:num_seqs + 1].copy_(t)
                if bucket > num_seqs:
                    # Padding rows are one-token sequences: keep counting from the last real one.
                    steps = torch.arange(1, bucket - num_seqs + 1, dtype=buf.dtype, device=buf.device)
                    torch.add(t[num_seqs:num_seqs + 1], steps, out=buf[num_seqs + 1:])
                continue
            if t.shape[1:] != buf.shape[1:]:
                if any(a > b for a, b in zip(t.shape[1:], buf.shape[1:])) or t.dim() != buf.dim():
                    raise ValueError(f"inputs[{name!r}] has shape {tuple(t.shape)}, the static "
                                     f"buffer holds at most {tuple(buf.shape)}")
                buf[:num_seqs].fill_(self.pad_values[name])
                buf[(slice(0, num_seqs), *(slice(0, n) for n in t.shape[1:]))].copy_(t)
            else:
                buf[:num_seqs].copy_(t)
            buf[num_seqs:].fill_(self.pad_values[name])

    def _capture(self, bucket: int, static) -> None:
        # Warm-up on a side stream first (lazy inits, autotuning and allocator growth must not
        # happen inside the capture), then capture into one memory pool shared by every bucket.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(**static)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[bucket] = self.fn(**static)
        except BaseException:
            # torch 2.11: when capture_end raises, torch.cuda.graph leaves its capture stream
            # current (later work would run on it, unordered with the engine's streams) and the
            # caching allocator still routing into the pool (every later empty_cache() asserts);
            # torch 2.12 fixed the allocator side. Undo both here.
            torch.cuda.set_stream(caller)
            _stop_routing_to_pool(self._pool)
            self._outputs.pop(bucket, None)
            raise
        self._graphs[bucket] = graph
        logger.info("captured a CUDA graph for decode batches of %d", bucket)


def _stop_routing_to_pool(pool) -> None:
    """End the allocator's routing into a graph pool that a failed capture left open."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(torch.cuda.current_device(), pool)
    except RuntimeError:        # not routing any more (capture_end stopped it: torch >= 2.12)
        pass


def decode_graph_runner(runner, max_num_seqs: int, max_blocks_per_seq: int) -> DecodeGraphRunner:
    """Graphs of a runner's pure-decode steps (runner.forward_logits, one token per sequence).

    Its inputs are the step tensors of a decode batch: input_ids, positions, slot_mapping
    int64 [num_seqs]; seq_lens int32 [num_seqs]; block_tables int32 [num_seqs,
    <= max_blocks_per_seq]; cu_seqlens_q int32 [num_seqs + 1]. It returns fp32 logits
    [num_seqs, vocab_size].
    """
    def decode(input_ids, positions, slot_mapping, seq_lens, block_tables, cu_seqlens_q):
        attn = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                                 layout=runner.layout)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return runner.forward_logits(input_ids, positions, rows, attn)

    buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
    return DecodeGraphRunner(decode, {"input_ids": 0, "positions": 0, "slot_mapping": -1,
                                      "seq_lens": 1, "block_tables": 0, "cu_seqlens_q": 0},
                             max_shapes={"block_tables": (max_blocks_per_seq,)},
                             cumulative=("cu_seqlens_q",), buckets=buckets, device=runner.device)
