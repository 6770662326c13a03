"""KV cache ops: write_kv (scatter new K/V into slots), copy_blocks (copy-on-write inside one
pool, every layer in one call) and swap_blocks (device pool <-> host pool, every layer in one call).

Layout (DESIGN.md): a layer's cache is [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset; slot -1 skips a token. The C++ and CUDA kernels move bytes, so one
kernel serves every dtype and results are bit-exact by construction.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from cb_kernels import _C
from cb_kernels.ops import reference
from cb_kernels.ops._backend import (cuda_kernels_error, resolve_backend, sync_threads, triton_error)
from cb_kernels.ops._cache_checks import (Pool, check_block_mapping, check_pool_list, check_same_geometry,
                                          check_slot_values, check_write_kv, pools_overlap)

WRITE_KV_BACKENDS = ("cuda", "triton", "cpu", "torch")
COPY_BLOCKS_BACKENDS = ("cuda", "cpu", "torch")
SWAP_BLOCKS_BACKENDS = ("cuda", "cpu", "torch")


def _default_cuda(supported) -> str:
    if not cuda_kernels_error():
        return "cuda"
    if "triton" in supported and not triton_error():
        return "triton"
    return "torch"


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None) -> None:
    """Write each token's K and V into its cache slot, in place.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_dim], any strides with head_dim packed.
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], same dtype as key; any
        strides with head_dim packed (transformers' per-layer views work in place).
    slot_mapping : int64 [num_tokens] on the caches' device; -1 skips the token. Slots outside
        the pool or written twice raise ValueError; on CUDA that check costs one host sync (it is
        skipped while a CUDA graph is captured, and the kernels then skip out-of-pool slots).
    backend : None (fastest here), "cuda", "triton", "cpu" or "torch" (the reference).
    """
    if torch.compiler.is_compiling():
        torch.ops.cb_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping, backend)
    else:
        _write_kv(key, value, k_cache, v_cache, slot_mapping, backend)


def _write_kv(key, value, k_cache, v_cache, slot_mapping, backend) -> None:
    device = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    check_slot_values(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    chosen = resolve_backend(backend, device, WRITE_KV_BACKENDS, _default_cuda(WRITE_KV_BACKENDS), "write_kv")
    run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping)


def write_kv_unchecked(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    """The engine's hot path: `write_kv` without the slot-value check, so no host sync on CUDA.

    Shapes, dtypes, strides and devices are still checked (tensor metadata, free). The caller
    vouches for the slot values: the engine builds slot_mapping on the host from its own block
    tables and checks it there once per step (runner/step_inputs.py, `check_slots`), before the upload.
    The C++, CUDA and Triton kernels skip slots outside the pool in any case, so a bad value can
    drop a token but never write outside the caches. Same arguments as `write_kv`.
    """
    if torch.compiler.is_compiling():   # traced: the registered op (its fake reads no values)
        torch.ops.cb_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping, backend)
        return
    device = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    chosen = resolve_backend(backend, device, WRITE_KV_BACKENDS, _default_cuda(WRITE_KV_BACKENDS), "write_kv")
    run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping)


def run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping) -> None:
    """Run one backend on checked arguments (also the body of the torch.library op)."""
    if key.shape[0] == 0:
        return
    if chosen == "torch":
        reference.ref_write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif chosen == "triton":
        from cb_kernels.triton.write_kv import triton_write_kv
        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        args = _write_kv_args(key, value, k_cache, v_cache, slot_mapping)
        if chosen == "cpu":
            sync_threads()
            _C.write_kv(*args)
        else:
            from cb_kernels.ops import _cuda_cache
            _cuda_cache.write_kv(args, key.device)


def _write_kv_args(key, value, k_cache, v_cache, slot_mapping) -> tuple:
    es = key.element_size()
    return (key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
            key.shape[0], key.shape[1], k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1], key.shape[2] * es,
            (key.stride(0) * es, key.stride(1) * es), (value.stride(0) * es, value.stride(1) * es),
            tuple(s * es for s in k_cache.stride()[:3]), tuple(s * es for s in v_cache.stride()[:3]))


def copy_blocks(k_caches, v_caches, block_mapping, *, backend=None) -> None:
    """Copy block src to block dst in every layer's K and V cache (copy-on-write of prefix forks).

    Parameters
    ----------
    k_caches, v_caches : lists over layers of [num_blocks, block_size, num_kv_heads, head_dim]
        (any [num_blocks, ...] packed inside a block), all in one pool: same device and block count.
    block_mapping : int64 [n, 2] CPU tensor of (src, dst) block ids; destinations distinct and
        never also a source.
    backend : None, "cuda", "cpu" or "torch".
    """
    if torch.compiler.is_compiling():
        torch.ops.cb_kernels.copy_blocks(list(k_caches), list(v_caches), block_mapping, backend)
    else:
        _copy_blocks(k_caches, v_caches, block_mapping, backend)


def _check_copy_pool(k_caches, v_caches) -> Pool:
    k_pool = check_pool_list(k_caches, "k_caches")
    v_pool = check_pool_list(v_caches, "v_caches")
    check_same_geometry(k_pool.tensors, v_pool.tensors, "k_caches", "v_caches")
    if v_pool.device != k_pool.device or v_pool.num_blocks != k_pool.num_blocks:
        raise ValueError(f"v_caches ({v_pool.num_blocks} blocks on {v_pool.device}) must share the pool "
                         f"of k_caches ({k_pool.num_blocks} blocks on {k_pool.device})")
    return Pool(*(a + b for a, b in zip(k_pool[:3], v_pool[:3])), k_pool.num_blocks, k_pool.device)


def _copy_blocks(k_caches, v_caches, block_mapping, backend) -> None:
    pool = _check_copy_pool(k_caches, v_caches)
    n = check_block_mapping(block_mapping, pool.num_blocks, pool.num_blocks, same_pool=True)
    chosen = resolve_backend(backend, pool.device, COPY_BLOCKS_BACKENDS, _default_cuda(COPY_BLOCKS_BACKENDS),
                             "copy_blocks")
    if n:
        _run_block_copy(chosen, pool, pool, block_mapping, None)


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
    _swap_blocks(src_caches, dst_caches, block_mapping, stream=stream, backend=None)


def _swap_blocks(src_caches, dst_caches, block_mapping, *, stream, backend, cuda_method="auto") -> None:
    """swap_blocks with a backend choice, for tests and benchmarks. cuda_method: "auto", "batch"
    (cuMemcpyBatchAsync), "kernel" (copy kernel over mapped pinned memory) or "memcpy" (one
    cudaMemcpyAsync per run of blocks); device <-> device copies always take the kernel."""
    src = check_pool_list(src_caches, "src_caches")
    dst = check_pool_list(dst_caches, "dst_caches")
    check_same_geometry(src.tensors, dst.tensors, "src_caches", "dst_caches")
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
        chosen = "cpu" if device.type == "cpu" else _default_cuda(SWAP_BLOCKS_BACKENDS)
    else:
        chosen = resolve_backend(backend, device, SWAP_BLOCKS_BACKENDS, "cuda", "swap_blocks")
    if n:
        _run_block_copy(chosen, src, dst, block_mapping, stream, cuda_method)


def _stream_handle(stream, device: torch.device) -> int:
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def _run_block_copy(chosen, src: Pool, dst: Pool, block_mapping, stream, cuda_method="auto") -> None:
    """dst.tensors[i][d] = src.tensors[i][s] for every pair (s, d), on checked arguments."""
    if chosen == "torch":
        _torch_block_copy(src.tensors, dst.tensors, block_mapping, stream)
        return
    args = (src.ptrs(), dst.ptrs(), src.block_bytes, src.block_strides, dst.block_strides, block_mapping.data_ptr(),
            block_mapping.shape[0])
    if chosen == "cpu":
        sync_threads()
        _C.copy_blocks(*args)
    else:
        from cb_kernels.ops import _cuda_cache
        device = dst.device if src.device.type == "cpu" else src.device
        handle = _stream_handle(stream, device)
        if not _cuda_cache.block_copy(src.tensors, dst.tensors, block_mapping, handle, args, cuda_method):
            _torch_block_copy(src.tensors, dst.tensors, block_mapping, handle)


def _torch_block_copy(src_caches, dst_caches, block_mapping, stream) -> None:
    """Pure-torch copy: one gather, one transfer and one scatter per tensor (transformers' way;
    indexing rather than index_copy_, which has no float8 kernel on CPU).

    Gathering first means no pair can read another pair's output, like the kernels.
    """
    cuda = next((t.device for t in (src_caches[0], dst_caches[0]) if t.is_cuda), None)
    ctx = contextlib.nullcontext()
    if cuda is not None and stream is not None:
        ctx = torch.cuda.stream(_as_stream(stream, cuda))
    with ctx:
        src_ids = block_mapping[:, 0].to(src_caches[0].device)
        dst_ids = block_mapping[:, 1].to(dst_caches[0].device)
        for s, d in zip(src_caches, dst_caches):
            d[dst_ids] = s[src_ids].to(d.device)


def _as_stream(stream, device):
    if isinstance(stream, int):
        from cb_kernels.ops._cuda_cache import torch_stream
        return torch_stream(stream, device)
    return stream



# torch.library ops, so torch.compile and CUDA graphs can trace the calls: the mutated caches are
# in the schema, and the fake implementations check shapes (block ids are data, checked at run).
@torch.library.custom_op("cb_kernels::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, backend: Optional[str] = None) -> None:
    _write_kv(key, value, k_cache, v_cache, slot_mapping, backend)


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    check_write_kv(key, value, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("cb_kernels::copy_blocks", mutates_args=("k_caches", "v_caches"))
def _copy_blocks_op(k_caches: List[torch.Tensor], v_caches: List[torch.Tensor], block_mapping: torch.Tensor,
                    backend: Optional[str] = None) -> None:
    _copy_blocks(k_caches, v_caches, block_mapping, backend)


@_copy_blocks_op.register_fake
def _(k_caches, v_caches, block_mapping, backend=None) -> None:
    _check_copy_pool(k_caches, v_caches)
