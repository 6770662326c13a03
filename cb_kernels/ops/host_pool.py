"""HostPool: the host side of CPU offload, shaped like a device pool.

transformers' offload asks for `torch.empty(..., pin_memory=True)`, which raises on a CPU-only
torch; here pinning is a speed-up, never a requirement.
"""
from __future__ import annotations

import logging
import weakref

import torch

from cb_kernels.ops._cache_checks import check_pool_list

logger = logging.getLogger(__name__)

# Each tensor's region starts on a 4 KiB boundary: page-aligned blocks keep the CPU copy on its
# fast path and satisfy the 16-byte alignment the CUDA copy kernel wants.
_ALIGN = 4096


class HostPool:
    """Host buffers with the block geometry of a device pool, allocated once.

    Parameters
    ----------
    like : list of [num_device_blocks, ...] tensors (the device pool: one per layer and per K/V).
        The host pool copies each tensor's dtype and block shape, not its contents.
    num_blocks : host blocks per tensor (block ids 0 .. num_blocks-1).
    pin_memory : None pins when CUDA is available; True asks for it. When pinning fails the pool
        falls back to plain memory with a warning (`pinned` tells which one you got).

    Attributes
    ----------
    caches : list of [num_blocks, ...] CPU tensors, `caches[i]` shaped like `like[i]`, views of one
        allocation; pass it to `swap_blocks` as src_caches or dst_caches.
    pinned : whether the buffer is page-locked.
    nbytes : size of the whole allocation.
    """

    def __init__(self, like, num_blocks: int, *, pin_memory: bool | None = None):
        like = check_pool_list(like, "like").tensors
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, got {type(pin_memory).__name__}")
        offsets, total = [], 0
        for t in like:
            offsets.append(total)
            nbytes = num_blocks * t[0].numel() * t.element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        want_pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        raw = torch.empty(total + _ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % _ALIGN
        # Only the page-aligned span the views use is registered: the driver pins whole pages,
        # and an unaligned range shares its first and last page with the neighbouring
        # allocations, so a second pool there failed to pin (cudaErrorHostMemoryAlreadyRegistered).
        self.pinned = want_pinned and _pin(raw, raw.data_ptr() + start, total)
        self.num_blocks = num_blocks
        self.nbytes = total
        self.caches = []
        for off, t in zip(offsets, like):
            nbytes = num_blocks * t[0].numel() * t.element_size()
            view = raw[start + off:start + off + nbytes].view(t.dtype).view(num_blocks, *t.shape[1:])
            # Each view keeps the registered buffer (and so its pinning) alive on its own: callers
            # may keep `caches` and drop the pool.
            view._cbk_host_buffer = raw
            self.caches.append(view)

    @property
    def block_nbytes(self) -> int:
        """Bytes one block id holds across every tensor of the pool."""
        return sum(t[0].numel() * t.element_size() for t in self.caches)

    def __repr__(self) -> str:
        return (f"HostPool(num_tensors={len(self.caches)}, num_blocks={self.num_blocks}, "
                f"nbytes={self.nbytes}, pinned={self.pinned})")


def _pin(owner: torch.Tensor, ptr: int, nbytes: int) -> bool:
    """Page-lock [ptr, ptr + nbytes) for as long as `owner` (the buffer holding it) lives.

    Pinning goes through cudaHostRegister on plain memory, not `pin_memory=True`: torch's pinned
    allocator rounds every request up to a power of two, so a 40 GiB pool would lock 64 GiB.
    """
    try:
        cudart = torch.cuda.cudart()
        # Portable | Mapped: usable from every device, and readable by the swap copy kernel.
        rc = int(cudart.cudaHostRegister(ptr, nbytes, 0x1 | 0x2))
    except (RuntimeError, AssertionError, AttributeError) as e:  # CPU-only torch, no driver
        why = str(e)
    else:
        if rc == 0:
            weakref.finalize(owner, _unregister, cudart, ptr)
            return True
        why = f"cudaHostRegister failed with CUDA error {rc} (a locked-memory limit?)"
    logger.warning("HostPool: pinned memory unavailable (%s); using plain memory, swaps will be "
                   "slower", why)
    return False


def _unregister(cudart, ptr: int) -> None:
    try:
        cudart.cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown after CUDA teardown: the process frees it anyway
        pass
