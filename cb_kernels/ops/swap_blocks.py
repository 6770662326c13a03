"""`swap_blocks`: move blocks between a device pool and a host pool (or two host pools), every
layer's K and V in one call: the CPU offload's swap-out and swap-in.

Backends: "cpu" (csrc/cpu), "cuda" (csrc/cuda: cuMemcpyBatchAsync, a copy kernel over mapped
pinned memory, or cudaMemcpyAsync runs), "torch" (ops/_block_copy.py's pure-torch copy;
`ref_swap_blocks` in ops/reference.py is the tests' oracle).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from cb_kernels.ops._backend import default_cuda_backend, resolve_backend
from cb_kernels.ops._block_copy import run_block_copy
from cb_kernels.ops._cache_checks import Pool, check_block_mapping, check_pool_list, check_same_geometry, pools_overlap

SWAP_BLOCKS_BACKENDS = ("cuda", "cpu", "torch")


def swap_blocks(src_caches, dst_caches, block_mapping, *, stream=None) -> None:
    """Move blocks between two pools (device <-> host, or host <-> host), every tensor in one call.

    Parameters
    ----------
    src_caches, dst_caches : equal-length lists of [num_blocks, ...] tensors (one per layer and per
        K/V; pair i has one dtype and block shape; block counts may differ between the pools).
        Block b of every tensor moves together. A CUDA <-> host swap wants pinned host memory
        (`HostPool`); pageable host memory falls back to a slower, host-synchronous copy.
    block_mapping : int64 [n, 2] CPU tensor of (src, dst) block ids, destinations distinct.
    stream : torch.cuda.Stream, its int handle (`.cuda_stream`), or None for the current stream
        of the CUDA side. The copies are queued on it; nothing here waits for them.
    """
    if torch.compiler.is_compiling():   # traced: the registered op, the stream as its handle
        handle = None if stream is None or isinstance(stream, int) else stream.cuda_stream
        torch.ops.cb_kernels.swap_blocks(list(src_caches), list(dst_caches), block_mapping,
                                         stream if isinstance(stream, int) else handle)
        return
    _swap_blocks(src_caches, dst_caches, block_mapping, stream=stream, backend=None)


def _swap_blocks(src_caches, dst_caches, block_mapping, *, stream, backend, cuda_method="auto") -> None:
    """swap_blocks with a backend choice, for tests and benchmarks. cuda_method: "auto", "batch"
    (cuMemcpyBatchAsync), "kernel" (copy kernel over mapped pinned memory) or "memcpy" (one
    cudaMemcpyAsync per run of blocks); device <-> device copies always take the kernel."""
    src, dst = _check_pools(src_caches, dst_caches)
    src_dev, dst_dev = src.device, dst.device
    # Views of one pool on both sides: a destination must then never be a source, or the result
    # would depend on copy order.
    n = check_block_mapping(block_mapping, src.num_blocks, dst.num_blocks, same_pool=pools_overlap(src, dst))
    cuda_devs = {d for d in (src_dev, dst_dev) if d.type == "cuda"}
    if len(cuda_devs) > 1:
        raise ValueError(f"src_caches on {src_dev} and dst_caches on {dst_dev}: "
                         f"swaps between two GPUs are not supported")
    if not cuda_devs and stream is not None:
        raise ValueError("stream must be None when neither src_caches nor dst_caches is on CUDA")
    if stream is not None and not isinstance(stream, int) and not hasattr(stream, "cuda_stream"):
        raise TypeError(f"stream must be a torch.cuda.Stream, an int handle or None, got {type(stream).__name__}")
    device = next(iter(cuda_devs)) if cuda_devs else src_dev
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"swap_blocks supports CPU and CUDA tensors, got {device}")
    if backend is None:
        chosen = "cpu" if device.type == "cpu" else default_cuda_backend(SWAP_BLOCKS_BACKENDS)
    else:
        chosen = resolve_backend(backend, device, SWAP_BLOCKS_BACKENDS, "cuda", "swap_blocks")
    if n:
        run_block_copy(chosen, src, dst, block_mapping, stream, cuda_method)


def _check_pools(src_caches, dst_caches) -> tuple[Pool, Pool]:
    src = check_pool_list(src_caches, "src_caches")
    dst = check_pool_list(dst_caches, "dst_caches")
    check_same_geometry(src.tensors, dst.tensors, "src_caches", "dst_caches")
    return src, dst


# `stream` is the CUDA stream's int handle in the schema (a torch.cuda.Stream is no schema type).
@torch.library.custom_op("cb_kernels::swap_blocks", mutates_args=("dst_caches",))
def _swap_blocks_op(src_caches: List[torch.Tensor], dst_caches: List[torch.Tensor], block_mapping: torch.Tensor,
                    stream: Optional[int] = None, backend: Optional[str] = None) -> None:
    _swap_blocks(src_caches, dst_caches, block_mapping, stream=stream, backend=backend)


@_swap_blocks_op.register_fake
def _(src_caches, dst_caches, block_mapping, stream=None, backend=None) -> None:
    _check_pools(src_caches, dst_caches)
