"""CUDA side of the cache ops: device tables for the copy kernel and the swap path choice.

Block mappings stay on the CPU (see `check_block_mapping`): the batched copy-engine path needs
host arrays of pointers, and the kernel path gets its (small) table through one pinned
host-to-device copy queued on the same stream, so no path waits on the device.
"""
from __future__ import annotations

import os

import torch

from cb_kernels import _C

# Swaps whose blocks are at least this large go through cuMemcpyBatchAsync (copy engines, no SM
# time); smaller ones through the copy kernel reading mapped pinned memory, which pays no
# per-copy setup. 64 KiB is a starting point, not a measurement yet: bench/bench_swap_blocks.py
# --device cuda prints both paths per block size; override with CBK_SWAP_BATCH_MIN_BYTES.
BATCH_MIN_BYTES = int(os.environ.get("CBK_SWAP_BATCH_MIN_BYTES", 64 << 10))

SWAP_METHODS = {"auto": 0, "batch": 1, "kernel": 2, "memcpy": 3}


def write_kv(args: tuple, device: torch.device) -> None:
    with torch.cuda.device(device):
        _C.write_kv_cuda(*args, torch.cuda.current_stream(device).cuda_stream)


def block_copy(src_caches, dst_caches, block_mapping, stream: int, args: tuple, method: str = "auto") -> bool:
    """dst_caches[i][dst] = src_caches[i][src] on `stream`; False (nothing queued) when a host
    side is pageable memory, which none of these paths can read without a host sync.

    args: (src_ptrs, dst_ptrs, block_bytes, src_strides, dst_strides, mapping_ptr, num_pairs)
    as built by _block_copy.run_block_copy.
    """
    src_ptrs, dst_ptrs, block_bytes, src_strides, dst_strides, mapping_ptr, n = args
    src_host, dst_host = not src_caches[0].is_cuda, not dst_caches[0].is_cuda
    device = dst_caches[0].device if src_host else src_caches[0].device
    with torch.cuda.device(device):
        if not (src_host or dst_host):
            _kernel_copy(args, src_ptrs, dst_ptrs, block_mapping, stream, device)
            return True
        mapped_src = [_C.cuda_host_device_pointer(p) for p in src_ptrs] if src_host else src_ptrs
        mapped_dst = [_C.cuda_host_device_pointer(p) for p in dst_ptrs] if dst_host else dst_ptrs
        if 0 in mapped_src or 0 in mapped_dst:
            return False
        chosen = _C.cuda_swap_method(min(block_bytes), stream, SWAP_METHODS[method], BATCH_MIN_BYTES)
        if chosen == SWAP_METHODS["kernel"]:
            _kernel_copy(args, mapped_src, mapped_dst, block_mapping, stream, device)
        else:
            _C.memcpy_blocks_cuda(src_ptrs, dst_ptrs, block_bytes, src_strides, dst_strides, mapping_ptr, n,
                                  chosen == SWAP_METHODS["batch"], stream)
    return True


def _kernel_copy(args, src_ptrs, dst_ptrs, block_mapping, stream: int, device) -> None:
    """One launch of the block-copy kernel; its table travels in one pinned H2D copy on `stream`."""
    _, _, block_bytes, src_strides, dst_strides, _, n = args
    num_tensors = len(block_bytes)
    rows = [v for row in zip(src_ptrs, dst_ptrs, block_bytes, src_strides, dst_strides) for v in row]
    host = torch.empty(5 * num_tensors + 2 * n, dtype=torch.int64, pin_memory=True)
    host[:5 * num_tensors] = torch.tensor(rows, dtype=torch.int64)
    host[5 * num_tensors:] = block_mapping.view(-1)
    # The caching allocators tie `host` and `dev` to this stream, so neither is reused before
    # the kernel that reads them has run.
    with torch.cuda.stream(torch_stream(stream, device)):
        dev = host.to(device, non_blocking=True)
    table = dev.data_ptr()
    _C.copy_blocks_cuda(args[0], args[1], block_bytes, src_strides, dst_strides, n, table,
                        table + 8 * 5 * num_tensors, stream)


def torch_stream(handle: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream object of a raw handle (the current stream itself when it matches)."""
    current = torch.cuda.current_stream(device)
    if handle == current.cuda_stream:
        return current
    return torch.cuda.ExternalStream(handle, device=device)
