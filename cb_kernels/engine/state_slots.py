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
slot it wrote in an earlier step.
"""
from __future__ import annotations

import torch

from cb_kernels.engine.sequence import Sequence


class StateSlots:
    """Free list and owners of `num_slots` slots over `tensors` (each [num_slots, ...])."""

    def __init__(self, num_slots: int, tensors: list, bytes_per_slot: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
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

    def stats(self) -> dict:
        return {"state_slots_used": self.num_used, "state_slots_total": self.num_slots,
                "state_bytes_per_slot": self.bytes_per_slot,
                "state_fork_copies": self.num_fork_copies}


EMPTY_STATS = {"state_slots_used": 0, "state_slots_total": 0, "state_bytes_per_slot": 0,
               "state_fork_copies": 0}
