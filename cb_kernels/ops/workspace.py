"""One grow-only scratch buffer per thread for the CPU kernels' workspaces.

Why: a wrapper that allocated its `*_workspace_bytes` scratch with a fresh `torch.empty` per
call got, for a multi-MB size, a fresh mmap whose pages fault on first write (about 10 us a fault
in a Firecracker VM) until glibc's dynamic mmap threshold rose; a new Engine (its construction
frees and allocates a lot) paid it again. In the first generate() of bench_hybrid's
qwen3-next-hd128 shape (bf16, 2 Zen 4 cores) gated_delta_net_block took 5300 faults (21 MB), its
first prefill call per layer 23 ms against 3.2 ms later. One buffer per thread, kept, faults once
per process; `reserve` (Engine construction) faults it before the first step.

The contract, for a wrapper that calls `scratch`:
- the tensor is the calling thread's buffer, valid until that thread's next `scratch` call: a
  wrapper takes it once, hands it to one kernel call and drops it;
- it holds whatever the last call left (zeros only when fresh): a kernel writes its scratch
  before it reads it (tests/ops/test_workspace.py runs every user on a buffer of 0xFF bytes);
- it is never returned to the caller, nor a view of it (outputs get their own tensors).
CPU only: CUDA paths keep their own allocations (the caching allocator has no such cost).
"""
from __future__ import annotations

import threading
import weakref

import torch

# Buffers grow in steps of this many bytes, so steps of slowly rising size do not reallocate
# each time; torch.empty's base address is already 64-byte aligned (the kernels' assumption).
_GRANULE = 1 << 16
ALIGN = 64


class _Holder:
    """One thread's buffer (a uint8 CPU tensor, empty until its first use)."""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8)


# Module-level on purpose (STYLE habit 6 keeps engine state out of globals): scratch belongs to
# the thread running the kernels, as the C++ MoE op's per-thread work buffers do, so a new Engine
# in the same thread finds it faulted in already.
_local = threading.local()
_holders: "weakref.WeakSet[_Holder]" = weakref.WeakSet()    # every thread's, for release()
_holders_lock = threading.Lock()


def _holder() -> _Holder:
    h = getattr(_local, "holder", None)
    if h is None:
        h = _local.holder = _Holder()
        with _holders_lock:
            _holders.add(h)
    return h


def _grow(h: _Holder, nbytes: int) -> None:
    if h.buf.numel() < nbytes:
        h.buf = torch.empty(0, dtype=torch.uint8)     # the old one freed before the new one
        # a normal tensor even when grown inside a step's inference_mode, so `reserve` (outside
        # it) may write it
        with torch.inference_mode(False):
            h.buf = torch.empty(-(-nbytes // _GRANULE) * _GRANULE, dtype=torch.uint8)


def scratch(nbytes: int) -> torch.Tensor:
    """A uint8 ``[nbytes]`` view of this thread's buffer (grown to fit), 64-byte aligned; its
    bytes are whatever an earlier call left."""
    h = _holder()
    _grow(h, nbytes)
    return h.buf[:nbytes]


def scratch_parts(sizes: list) -> list:
    """uint8 views of this thread's buffer, one per entry of `sizes` (bytes), disjoint, each
    64-byte aligned: several scratch tensors of one kernel call from one buffer."""
    offsets = _offsets(sizes)
    buf = scratch(offsets[-1])
    return [buf[o:o + n] for o, n in zip(offsets, sizes)]


def _offsets(sizes: list) -> list:
    """Each part's offset in the buffer, then the bytes of all (parts 64-byte aligned)."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // ALIGN) * ALIGN)
    return offsets


def parts_bytes(sizes: list) -> int:
    """The buffer bytes `scratch_parts(sizes)` takes."""
    return _offsets(sizes)[-1]


def reserve(nbytes: int) -> int:
    """Grow this thread's buffer to at least `nbytes` and write all of it (zeros), so no call
    up to that size faults a page; returns the bytes the buffer holds."""
    h = _holder()
    _grow(h, nbytes)
    h.buf.zero_()
    return h.buf.numel()


def held_bytes() -> int:
    """Bytes the buffers hold, over every live thread."""
    with _holders_lock:
        return sum(h.buf.numel() for h in _holders)


def release() -> int:
    """Free every thread's buffer (the next call allocates again); returns the bytes freed. A
    call running at that moment keeps its view (and so its memory) until it returns."""
    freed = 0
    with _holders_lock:
        for h in _holders:
            freed += h.buf.numel()
            h.buf = torch.empty(0, dtype=torch.uint8)
    return freed
