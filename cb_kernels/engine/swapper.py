"""Swapper: the Scheduler's bridge to the OffloadManager (swap a victim out, bring it back).

A swapped sequence keeps its token state (`num_computed_tokens`) but holds no device block: the
KV of its computed tokens (the first `blocks_for(num_computed_tokens)` blocks of its table,
shared prefix blocks included, so that coming back never depends on the prefix cache) lives in
host blocks keyed by its seq_id. Swap-in gives it fresh device blocks for all its tokens and
copies the KV into the leading ones; the sequence then resumes exactly where it stopped.

Models with stateful layers (engine/state_slots.py): the sequence's state slot moves with its
blocks, into a host pool of slots built the same way (ops.HostPool, one host slot per device
slot, copied with ops.swap_blocks); no host slot free means recompute.
"""
from __future__ import annotations

import logging

from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.offload import OffloadError, OffloadManager
from cb_kernels.engine.preemption import PreemptionPolicy
from cb_kernels.engine.sequence import Sequence, SequenceStatus

__all__ = ["Swapper", "OffloadError", "make_swapper"]

logger = logging.getLogger("cb_kernels.engine")


class Swapper:
    def __init__(self, block_manager: BlockManager, offload: OffloadManager,
                 policy: PreemptionPolicy, state_offload: OffloadManager | None = None):
        self.block_manager = block_manager
        self.offload = offload
        self.policy = policy
        self.state_offload = state_offload     # the state slots' host pool, or None

    def freed_blocks(self, seq: Sequence) -> int:
        """Device blocks that preempting `seq` returns: those it alone references."""
        refs = self.block_manager.ref_counts
        return sum(1 for b in seq.block_table if refs[b] == 1)

    def num_swap_blocks(self, seq: Sequence) -> int:
        return self.block_manager.blocks_for(seq.num_computed_tokens)

    def choose(self, seq: Sequence) -> str:
        """"swap" or "recompute" for the victim `seq` (see PreemptionPolicy.choose)."""
        n, block_bytes = self.num_swap_blocks(seq), self.offload.block_bytes
        if self.state_offload is not None:
            if self.state_offload.num_free_host_blocks == 0 or seq.state_slot < 0:
                return "recompute"
            block_bytes += self.state_offload.block_bytes // max(n, 1)   # the slot moves too
        return self.policy.choose(num_tokens=seq.num_computed_tokens,
                                  swap_blocks=n,
                                  freed_blocks=self.freed_blocks(seq),
                                  block_bytes=block_bytes,
                                  host_free_blocks=self.offload.num_free_host_blocks)

    def swap_out(self, seq: Sequence) -> None:
        """Move `seq`'s computed KV to the host and free its device blocks.

        Raises OffloadError when the copy fails; `seq` then still holds its device blocks and
        no host block (the caller fails the request and frees them).
        """
        n = self.num_swap_blocks(seq)
        if self.state_offload is not None:
            self.state_offload.swap_out(seq.seq_id, [seq.state_slot])
        try:
            self.offload.swap_out(seq.seq_id, seq.block_table[:n])
        except BaseException:
            if self.state_offload is not None:
                self.state_offload.free(seq.seq_id)
            raise
        if self.offload.last_copy is not None:
            self.policy.record_copy(*self.offload.last_copy)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.SWAPPED

    def blocks_to_swap_in(self, seq: Sequence) -> int:
        """Device blocks `seq` needs to come back (every token it has, computed or not)."""
        return self.block_manager.blocks_for(seq.num_tokens)

    def swap_in(self, seq: Sequence) -> None:
        """Give `seq` device blocks again and copy its KV back; the caller checked the room.

        Raises OffloadError when the copy fails; every block (device and host) is returned then.
        """
        bm = self.block_manager
        num_computed, num_cached = seq.num_computed_tokens, seq.metrics.num_cached_tokens
        epoch = seq.kv_epoch                    # the KV coming back is as old as it was
        bm.allocate(seq, [])
        seq.num_computed_tokens, seq.metrics.num_cached_tokens = num_computed, num_cached
        seq.kv_epoch = epoch
        n = len(self.offload.host_blocks(seq.seq_id))
        try:
            self.offload.swap_in(seq.seq_id, seq.block_table[:n])
        except OffloadError:
            bm.free(seq)
            if self.state_offload is not None:
                self.state_offload.free(seq.seq_id)
            raise
        if self.state_offload is not None:
            try:
                self.state_offload.swap_in(seq.seq_id, [seq.state_slot])
            except OffloadError:
                bm.free(seq)
                raise
        seq.status = SequenceStatus.RUNNING

    def drop(self, seq: Sequence) -> None:
        """Forget a swapped `seq` that ended (cancelled) without coming back."""
        self.offload.free(seq.seq_id)
        if self.state_offload is not None:
            self.state_offload.free(seq.seq_id)

    def check_invariants(self, swapped) -> None:
        """The host pool is consistent and its owners are exactly the swapped sequences."""
        self.offload.check_invariants()
        owners = self.offload.owners()
        ids = {seq.seq_id for seq in swapped}
        assert set(owners) == ids, f"host blocks owned by {sorted(owners)}, swapped seqs {sorted(ids)}"
        for seq in swapped:
            assert seq.status is SequenceStatus.SWAPPED and not seq.block_table, \
                f"{seq} is not swapped cleanly"
            assert owners[seq.seq_id] == self.num_swap_blocks(seq), \
                f"{seq} holds {owners[seq.seq_id]} host blocks"
            assert seq.state_slot < 0, f"{seq} is swapped but holds state slot {seq.state_slot}"
        if self.state_offload is not None:
            self.state_offload.check_invariants()
            state_owners = self.state_offload.owners()
            assert state_owners == {i: 1 for i in ids}, \
                f"host state slots owned by {sorted(state_owners)}, swapped seqs {sorted(ids)}"


def make_swapper(block_manager: BlockManager, device_caches: list, cpu_offload_gib: float,
                 preemption: str, orchestrator) -> Swapper | None:
    """The Swapper of an engine, or None when it recomputes only (no pool, or no room for one
    block of `device_caches`, the per-layer K and V tensors [num_blocks, block_size, ...])."""
    if preemption == "recompute" or not cpu_offload_gib:
        return None
    block_bytes = sum(t[0].numel() * t.element_size() for t in device_caches)
    num_host_blocks = int(cpu_offload_gib * (1 << 30)) // block_bytes
    if num_host_blocks == 0:
        logger.warning("cpu_offload_gib=%.3g holds no %d-byte block; preemption recomputes",
                       cpu_offload_gib, block_bytes)
        return None
    offload = OffloadManager(device_caches, num_host_blocks, orchestrator=orchestrator)
    policy = PreemptionPolicy(preemption, device_caches[0].device.type)
    slots = block_manager.state_slots
    state_offload = None
    if slots is not None:
        # One host slot per device slot: at most max_num_seqs requests hold state at once.
        state_offload = OffloadManager(slots.tensors, slots.num_slots, orchestrator=orchestrator)
    logger.info("CPU swap pool: %d blocks (%.3f GiB, pinned=%s), preemption=%r", num_host_blocks,
                num_host_blocks * block_bytes / (1 << 30),
                bool(offload.host_caches and offload.host_caches[0].is_pinned()), preemption)
    return Swapper(block_manager, offload, policy, state_offload)
