"""State slots: the per-sequence state of stateful layers (SSM, conv window, linear attention)
beside the paged KV blocks, for models whose runner has them (runner/state_cache.py).

A running sequence owns exactly one slot, the same index in every state tensor of the runner's
pool (each [num_slots, ...]). The BlockManager takes it with the sequence's blocks (`allocate`)
and returns it with them (`free`: finish, cancel, failure, preemption), so every path that gives
blocks back gives the slot back too; a waiting or swapped sequence holds none (its state is
rebuilt from its tokens, or kept in the host pool by the Swapper). A fork (n > 1 samples) takes a
fresh slot for the child and copies the parent's state into it: the forks start from the state
the parent's prefill left. There are as many slots as max_num_seqs, and the scheduler never runs
more sequences, so admission never waits for a slot; `can_allocate` still checks.

A slot's content is never read before it is written: the runner starts a sequence whose
computed tokens are 0 from zero state, and only continues (decode, later prefill chunks) from a
slot it wrote in an earlier step, or that a checkpoint was copied into.

Checkpoints (prefix caching): a bounded pool of `num_checkpoints` more slots, each holding the
state a sequence had right after a full block (conv window and recurrent/SSM state, in separate
tensors shaped like the slots'), keyed by that block's prefix hash (block_manager.hash_block).
`save` copies a sequence's slot into one (the least recently used one is evicted when none is
free), `restore` copies one into a sequence's slot, `drop` forgets the checkpoint of a block the
prefix cache evicted, and `clear` forgets all of them (weights changed, sleep). The state after
a block depends only on the tokens up to it and the weights, both of which the chain hash and
the cache's epoch pin down, so a restored sequence continues exactly as if it had computed
those tokens itself.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from cb_kernels.engine.sequence import Sequence


class StateSlots:
    """Free list and owners of `num_slots` slots over `tensors` (each [num_slots, ...])."""

    def __init__(self, num_slots: int, tensors: list, bytes_per_slot: int,
                 num_checkpoints: int = 0):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        for t in tensors:
            if t.shape[0] != num_slots:
                raise ValueError(f"state tensor of shape {tuple(t.shape)} has not {num_slots} "
                                 "slots")
        self.num_slots = num_slots
        self.tensors = list(tensors)
        self.bytes_per_slot = bytes_per_slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict = {}          # slot -> seq_id
        self.num_allocated = 0
        self.num_fork_copies = 0
        # Checkpoints: per slot tensor one [num_checkpoints, ...] tensor (same dtype and device).
        self.num_checkpoints = num_checkpoints
        self.checkpoint_tensors = [
            torch.zeros((num_checkpoints, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for t in self.tensors] if num_checkpoints else []
        self._checkpoint_of: OrderedDict = OrderedDict()     # block hash -> index, oldest first
        self._free_checkpoints = list(range(num_checkpoints - 1, -1, -1))
        self.num_checkpoint_saves = 0
        self.num_checkpoint_hits = 0
        self.num_checkpoint_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, seq: Sequence) -> int:
        assert seq.state_slot < 0, f"{seq} already holds state slot {seq.state_slot}"
        if not self._free:
            raise RuntimeError(f"no free state slot for {seq} (all {self.num_slots} in use)")
        slot = self._free.pop()
        self._owner[slot] = seq.seq_id
        seq.state_slot = slot
        self.num_allocated += 1
        return slot

    def free(self, seq: Sequence) -> None:
        slot = seq.state_slot
        if slot < 0:
            return
        assert self._owner.get(slot) == seq.seq_id, f"{seq} frees slot {slot} it does not own"
        del self._owner[slot]
        self._free.append(slot)
        seq.state_slot = -1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` gets a slot holding a copy of `parent`'s state."""
        dst = self.allocate(child)
        src = parent.state_slot
        assert src >= 0, f"{parent} forks without a state slot"
        with torch.inference_mode():
            for t in self.tensors:
                t[dst].copy_(t[src])
        self.num_fork_copies += 1

    # -- checkpoints ----------------------------------------------------------------------------
    def has_checkpoint(self, block_hash: bytes) -> bool:
        return block_hash in self._checkpoint_of

    def checkpoint_hashes(self) -> list:
        return list(self._checkpoint_of)

    def save(self, seq: Sequence, block_hash: bytes) -> None:
        """Copy `seq`'s state (as it is after the block whose prefix hash is `block_hash`) into a
        checkpoint; an existing one for that hash only becomes the most recently used."""
        if not self.num_checkpoints:
            return
        if block_hash in self._checkpoint_of:
            self._checkpoint_of.move_to_end(block_hash)
            return
        assert self._owner.get(seq.state_slot) == seq.seq_id, f"{seq} saves a slot it does not own"
        if self._free_checkpoints:
            dst = self._free_checkpoints.pop()
        else:
            _, dst = self._checkpoint_of.popitem(last=False)
            self.num_checkpoint_evictions += 1
        with torch.inference_mode():
            for t, c in zip(self.tensors, self.checkpoint_tensors):
                c[dst].copy_(t[seq.state_slot])
        self._checkpoint_of[block_hash] = dst
        self.num_checkpoint_saves += 1

    def restore(self, seq: Sequence, block_hash: bytes) -> None:
        """Copy the checkpoint of `block_hash` into `seq`'s slot (a prefix-cache hit)."""
        src = self._checkpoint_of[block_hash]
        self._checkpoint_of.move_to_end(block_hash)
        assert self._owner.get(seq.state_slot) == seq.seq_id, \
            f"{seq} restores into a slot it does not own"
        with torch.inference_mode():
            for t, c in zip(self.tensors, self.checkpoint_tensors):
                t[seq.state_slot].copy_(c[src])
        self.num_checkpoint_hits += 1

    def drop(self, block_hash: bytes) -> None:
        """Forget the checkpoint of a block that left the prefix cache (evicted, unregistered)."""
        index = self._checkpoint_of.pop(block_hash, None)
        if index is not None:
            self._free_checkpoints.append(index)

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache was reset: new weights, sleep)."""
        self._free_checkpoints.extend(self._checkpoint_of.values())
        self._checkpoint_of.clear()

    def release_checkpoints(self) -> int:
        """Engine.sleep: free the checkpoint pool's memory (after clear()); the bytes freed."""
        assert not self._checkpoint_of, "release_checkpoints() with live checkpoints"
        freed = 0
        for c in self.checkpoint_tensors:
            freed += c.untyped_storage().nbytes()
            c.untyped_storage().resize_(0)
        return freed

    def restore_checkpoints(self) -> None:
        """Engine.wake_up: the checkpoint pool's memory again (zeros, all free)."""
        for c in self.checkpoint_tensors:
            if c.untyped_storage().nbytes() == 0:
                c.untyped_storage().resize_(c.numel() * c.element_size())
                with torch.inference_mode():
                    c.zero_()

    def check_invariants(self, seqs) -> None:
        """Owners are exactly `seqs` (every sequence holding device blocks), one slot each."""
        owners = {}
        for seq in seqs:
            assert seq.state_slot >= 0, f"{seq} holds blocks but no state slot"
            assert seq.state_slot not in owners, f"slot {seq.state_slot} has two owners"
            owners[seq.state_slot] = seq.seq_id
        assert owners == self._owner, (f"state slot owners {sorted(self._owner.items())[:8]} != "
                                       f"running {sorted(owners.items())[:8]}")
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot is twice in the free list"
        assert not free & set(owners), "a state slot is both free and owned"
        assert len(free) + len(owners) == self.num_slots, "a state slot is lost"
        used = set(self._checkpoint_of.values())
        assert len(used) == len(self._checkpoint_of), "two hashes share a checkpoint"
        assert not used & set(self._free_checkpoints), "a checkpoint is both free and used"
        assert len(used) + len(self._free_checkpoints) == self.num_checkpoints, \
            "a checkpoint is lost"

    def stats(self) -> dict:
        return {"state_slots_used": self.num_used, "state_slots_total": self.num_slots,
                "state_bytes_per_slot": self.bytes_per_slot,
                "state_fork_copies": self.num_fork_copies,
                "state_checkpoints_used": len(self._checkpoint_of),
                "state_checkpoints_total": self.num_checkpoints,
                "state_checkpoint_saves": self.num_checkpoint_saves,
                "state_checkpoint_hits": self.num_checkpoint_hits,
                "state_checkpoint_evictions": self.num_checkpoint_evictions}


EMPTY_STATS = {"state_slots_used": 0, "state_slots_total": 0, "state_bytes_per_slot": 0,
               "state_fork_copies": 0, "state_checkpoints_used": 0, "state_checkpoints_total": 0,
               "state_checkpoint_saves": 0, "state_checkpoint_hits": 0,
               "state_checkpoint_evictions": 0}
