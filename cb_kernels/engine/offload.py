"""OffloadManager: keeps preempted requests' KV blocks in a host pool instead of recomputing them.

The host pool has the device pool's block geometry (one host tensor per device cache tensor:
every layer, K and V). Host blocks have one owner each (a swapped request), so a free list and an
owner map are the whole allocator. Copies go through `cb_kernels.ops.swap_blocks`, issued by the
StreamOrchestrator on its copy streams (synchronously on CPU).

Contract with the scheduler: `swap_out` copies device blocks out and records the host blocks under
the request id; the caller frees the device blocks only after it returns. `swap_in` copies them
back into device blocks the caller allocated and returns the host blocks to the pool. A transfer
that raises returns every block the call took and raises OffloadError: the scheduler fails that
one request (its device blocks are the caller's to free) and keeps serving the others.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from cb_kernels.engine.streams import StreamOrchestrator


class OffloadError(RuntimeError):
    """A swap transfer failed; the manager has already returned every host block it took."""


def make_host_caches(device_caches: Sequence[torch.Tensor], num_host_blocks: int) -> list[torch.Tensor]:
    """Host tensors [num_host_blocks, *block_shape], one per device cache tensor, from ops.HostPool."""
    from cb_kernels.ops.host_pool import HostPool
    pool = HostPool(list(device_caches), num_host_blocks)
    return list(pool.caches)


class OffloadManager:
    """Host-side block pool and swap bookkeeping for preempted requests.

    Parameters
    ----------
    device_caches : list of Tensor
        The device pool, one tensor per layer and per K/V: ``[num_blocks, block_size,
        num_kv_heads, head_dim]`` (any ``[num_blocks, ...]`` works; block b moves as one).
    num_host_blocks : int
        Blocks in the host pool (0 disables swapping).
    host_caches : list of Tensor, optional
        A ready host pool ``[num_host_blocks, ...]`` per device tensor; built with HostPool when None.
    swap_fn : callable, optional
        ``swap_fn(src_caches, dst_caches, block_mapping, stream=...)``; ``ops.swap_blocks`` when None.
    orchestrator : StreamOrchestrator, optional
        Where copies are issued; a synchronous one for the caches' device when None.
    """

    def __init__(self, device_caches: Sequence[torch.Tensor], num_host_blocks: int, *,
                 host_caches: Sequence[torch.Tensor] | None = None, swap_fn: Callable | None = None,
                 orchestrator: StreamOrchestrator | None = None):
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        if not device_caches:
            raise ValueError("device_caches must hold at least one tensor")
        self.device_caches = list(device_caches)
        if host_caches is None:
            host_caches = make_host_caches(self.device_caches, num_host_blocks) if num_host_blocks else []
        self.host_caches = list(host_caches)
        if num_host_blocks and len(self.host_caches) != len(self.device_caches):
            raise ValueError(f"host_caches has {len(self.host_caches)} tensors, device_caches "
                             f"{len(self.device_caches)}")
        for i, h in enumerate(self.host_caches):
            if h.shape[0] != num_host_blocks or h.shape[1:] != self.device_caches[i].shape[1:]:
                raise ValueError(f"host_caches[{i}] has shape {tuple(h.shape)}, expected "
                                 f"{(num_host_blocks, *self.device_caches[i].shape[1:])}")
        if swap_fn is None:
            from cb_kernels.ops import swap_blocks as swap_fn
        self._swap_fn = swap_fn
        self.orchestrator = orchestrator or StreamOrchestrator(self.device_caches[0].device, "off")
        self.num_host_blocks = num_host_blocks
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.device_caches)
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._owned: dict[object, list[int]] = {}
        self.swaps_out = 0
        self.swaps_in = 0
        self.blocks_out = 0
        self.blocks_in = 0
        self.bytes_moved = 0
        self.failed_transfers = 0
        self.last_copy: tuple[int, float] | None = None   # (bytes, seconds) of a timed copy

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free)

    @property
    def host_used_blocks(self) -> int:
        return self.num_host_blocks - len(self._free)

    def can_swap_out(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= len(self._free)

    def holds(self, request_id) -> bool:
        return request_id in self._owned

    def owners(self) -> dict:
        """Request id -> number of host blocks it holds."""
        return {rid: len(blocks) for rid, blocks in self._owned.items()}

    def host_blocks(self, request_id) -> list[int]:
        return list(self._owned[request_id])

    def swap_out(self, request_id, device_blocks: Sequence[int]) -> list[int]:
        """Copy `device_blocks` to new host blocks owned by `request_id`; returns the host ids.

        The device blocks are still the caller's: free them after this returns. Raises ValueError
        when the pool lacks room or the request already holds host blocks, OffloadError when the
        copy fails (no host block is kept then).
        """
        device_blocks = [int(b) for b in device_blocks]
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if not device_blocks:
            raise ValueError("device_blocks must not be empty")
        if len(device_blocks) > len(self._free):
            raise ValueError(f"host pool has {len(self._free)} free blocks, swap_out needs "
                             f"{len(device_blocks)} (check can_swap_out first)")
        host_blocks = [self._free.pop() for _ in device_blocks]
        mapping = torch.tensor(list(zip(device_blocks, host_blocks)), dtype=torch.int64).view(-1, 2)
        try:
            self._transfer(self.device_caches, self.host_caches, mapping, "out")
        except Exception as e:
            self._free.extend(reversed(host_blocks))
            self.failed_transfers += 1
            raise OffloadError(f"swap-out of request {request_id!r} failed: {e}") from e
        self._owned[request_id] = host_blocks
        self.swaps_out += 1
        self.blocks_out += len(host_blocks)
        return host_blocks

    def swap_in(self, request_id, device_blocks: Sequence[int]) -> None:
        """Copy the host blocks of `request_id`, in order, into `device_blocks` and free them.

        On failure the host blocks are freed too (the request fails; its KV is gone) and
        OffloadError is raised; the device blocks stay the caller's to free.
        """
        if request_id not in self._owned:
            raise ValueError(f"request {request_id!r} holds no host blocks")
        host_blocks = self._owned[request_id]
        device_blocks = [int(b) for b in device_blocks]
        if len(device_blocks) != len(host_blocks):
            raise ValueError(f"device_blocks has {len(device_blocks)} ids, request {request_id!r} "
                             f"holds {len(host_blocks)} host blocks")
        mapping = torch.tensor(list(zip(host_blocks, device_blocks)), dtype=torch.int64).view(-1, 2)
        try:
            self._transfer(self.host_caches, self.device_caches, mapping, "in")
        except Exception as e:
            self.free(request_id)
            self.failed_transfers += 1
            raise OffloadError(f"swap-in of request {request_id!r} failed: {e}") from e
        self.free(request_id)
        self.swaps_in += 1
        self.blocks_in += len(device_blocks)

    def free(self, request_id) -> None:
        """Drop the host blocks of `request_id` (cancelled or failed while swapped); no-op if none."""
        blocks = self._owned.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def _transfer(self, src, dst, mapping: torch.Tensor, direction: str) -> None:
        start = time.perf_counter()
        if direction == "out":
            self.orchestrator.copy_out(lambda stream: self._swap_fn(src, dst, mapping, stream=stream),
                                       keep_alive=mapping)
        else:
            self.orchestrator.copy_in(lambda stream: self._swap_fn(src, dst, mapping, stream=stream),
                                      keep_alive=mapping)
        nbytes = mapping.shape[0] * self.block_bytes
        self.bytes_moved += nbytes
        self.last_copy = None
        if not self.orchestrator.asynchronous:
            # Issue time equals copy time only when the copy is synchronous.
            seconds = time.perf_counter() - start
            self.last_copy = (nbytes, seconds)

    def stats(self) -> dict:
        """Its counters; EMPTY_STATS has the same keys (an engine without a host pool)."""
        return {
            "host_total_blocks": self.num_host_blocks,
            "host_used_blocks": self.host_used_blocks,
            "host_occupancy": self.host_used_blocks / self.num_host_blocks if self.num_host_blocks else 0.0,
            "swaps_out": self.swaps_out,
            "swaps_in": self.swaps_in,
            "swap_blocks_out": self.blocks_out,
            "swap_blocks_in": self.blocks_in,
            "swap_bytes": self.bytes_moved,
            "swap_failures": self.failed_transfers,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless free + owned host blocks are exactly 0..num_host_blocks-1."""
        owned = [b for blocks in self._owned.values() for b in blocks]
        every = sorted(self._free + owned)
        assert every == list(range(self.num_host_blocks)), (
            f"host pool broken: {len(self._free)} free + {len(owned)} owned blocks of "
            f"{self.num_host_blocks}, duplicates or strays: "
            f"{sorted(set(b for b in every if every.count(b) > 1 or not 0 <= b < self.num_host_blocks))}")
        assert all(self._owned.values()), "a swapped request owns zero host blocks"


EMPTY_STATS = {"host_total_blocks": 0, "host_used_blocks": 0, "host_occupancy": 0.0,
               "swaps_out": 0, "swaps_in": 0, "swap_blocks_out": 0, "swap_blocks_in": 0,
               "swap_bytes": 0, "swap_failures": 0}
