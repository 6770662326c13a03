"""The copy both `copy_blocks` and `swap_blocks` run: dst.tensors[i][d] = src.tensors[i][s] for
every (s, d) pair of a block mapping, on arguments already checked."""
from __future__ import annotations

import contextlib

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import sync_threads
from cb_kernels.ops._cache_checks import Pool


def run_block_copy(chosen: str, src: Pool, dst: Pool, block_mapping, stream, cuda_method="auto") -> None:
    """Copy with backend `chosen`; stream: None, a torch.cuda.Stream or its int handle."""
    if chosen == "torch":
        torch_block_copy(src.tensors, dst.tensors, block_mapping, stream)
        return
    args = (src.ptrs(), dst.ptrs(), src.block_bytes, src.block_strides, dst.block_strides, block_mapping.data_ptr(),
            block_mapping.shape[0])
    if chosen == "cpu":
        sync_threads()
        _C.copy_blocks(*args)
    else:
        from cb_kernels.ops import _cuda_cache
        device = dst.device if src.device.type == "cpu" else src.device
        handle = stream_handle(stream, device)
        if not _cuda_cache.block_copy(src.tensors, dst.tensors, block_mapping, handle, args, cuda_method):
            torch_block_copy(src.tensors, dst.tensors, block_mapping, handle)


def stream_handle(stream, device: torch.device) -> int:
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return stream if isinstance(stream, int) else stream.cuda_stream


def torch_block_copy(src_caches, dst_caches, block_mapping, stream) -> None:
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
