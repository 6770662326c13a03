"""StateSlots on its own and inside the BlockManager: one slot per block-holding sequence, taken
and returned with its blocks, copied on fork; the invariant check catches a leaked slot."""
import pytest
import torch

from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import SamplingParams
from cb_kernels.engine.sequence import Sequence
from cb_kernels.engine.state_slots import StateSlots


def seq(i, n=5):
    return Sequence(i, f"r{i}", list(range(1, n + 1)), SamplingParams(max_new_tokens=4))


def manager(num_slots=2):
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    tensors = [torch.zeros(num_slots, 3, 2), torch.zeros(num_slots, 5)]
    bm.state_slots = StateSlots(num_slots, tensors, 3 * 2 * 4 + 5 * 4)
    return bm


def test_slots_follow_blocks():
    bm = manager()
    a, b, c = seq(0), seq(1), seq(2)
    for s in (a, b):
        assert bm.can_allocate(s, [])
        bm.allocate(s, [])
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert not bm.can_allocate(c, []), "no slot left: admission must wait"
    bm.check_invariants([a, b])
    bm.free(a)
    assert a.state_slot == -1 and bm.state_slots.num_free == 1
    bm.check_invariants([b])
    bm.allocate(c, [])
    bm.check_invariants([b, c])
    assert bm.state_slots.stats()["state_slots_used"] == 2


def test_fork_copies_the_parent_state():
    bm = manager()
    parent, child = seq(0), seq(1)
    bm.allocate(parent, [])
    t0, t1 = bm.state_slots.tensors
    t0[parent.state_slot] = 7.0
    t1[parent.state_slot] = torch.arange(5.0)
    bm.fork(parent, child)
    assert child.state_slot not in (-1, parent.state_slot)
    assert torch.equal(t0[child.state_slot], t0[parent.state_slot])
    assert torch.equal(t1[child.state_slot], torch.arange(5.0))
    assert bm.state_slots.num_fork_copies == 1
    bm.check_invariants([parent, child])


def test_invariants_catch_a_leaked_slot():
    bm = manager()
    a = seq(0)
    bm.allocate(a, [])
    with pytest.raises(AssertionError, match="state slot owners"):
        bm.state_slots.check_invariants([])        # a slot owned by nobody running
    b = seq(1)
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots = StateSlots(1, [torch.zeros(1, 2)], 8)
        slots.allocate(a.__class__(5, "x", [1], SamplingParams()))
        slots.allocate(b)


def test_bad_pool_is_refused():
    with pytest.raises(ValueError, match="has not 3 slots"):
        StateSlots(3, [torch.zeros(2, 4)], 16)
