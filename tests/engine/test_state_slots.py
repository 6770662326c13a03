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


# -- checkpoints (prefix caching of stateful models) ---------------------------------------------
def cached_manager(num_checkpoints=2, num_blocks=16, min_tail_blocks=1):
    """min_tail_blocks=1: every prompt's last full block is a target (the tests below pin that
    placement); the default rule (2) has its own test."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=True, min_tail_blocks=min_tail_blocks)
    tensors = [torch.zeros(3, 3, 2), torch.zeros(3, 5)]
    bm.state_slots = StateSlots(3, tensors, 3 * 2 * 4 + 5 * 4, num_checkpoints)
    return bm


def seq_of(i, tokens):
    return Sequence(i, f"r{i}", list(tokens), SamplingParams(max_new_tokens=4))


def run_prefill(bm, s, fill):
    """Admit `s`, run its prefill chunk by chunk as the scheduler cuts it (align_chunk), each
    chunk one issued step whose state write is `fill` + tokens computed so far."""
    hits = bm.match_prefix(s)
    bm.allocate(s, hits)
    chunks = []
    while s.num_computed_tokens < s.num_tokens:
        bm.begin_step()
        n = bm.align_chunk(s, s.num_tokens - s.num_computed_tokens)
        bm.commit(s, s.num_computed_tokens + n)
        s.num_computed_tokens += n
        for t in bm.state_slots.tensors:
            t[s.state_slot] = fill + s.num_computed_tokens
        bm.end_step()
        chunks.append(n)
    return hits, chunks


def test_prefill_checkpoints_its_last_full_block_and_a_repeat_restores_it():
    """A 10-token prompt (blocks of 4) runs as 8 + 2 tokens; the state after token 8 is saved
    and the same prompt later hits 2 blocks and starts from a copy of that state."""
    bm = cached_manager()
    a = seq_of(0, range(1, 11))
    hits, chunks = run_prefill(bm, a, fill=100.0)
    assert (hits, chunks) == ([], [8, 2])
    assert bm.state_slots.stats()["state_checkpoint_saves"] == 1
    bm.free(a)
    bm.check_invariants([])
    b = seq_of(1, range(1, 11))
    hits, chunks = run_prefill(bm, b, fill=200.0)
    assert len(hits) == 2 and chunks == [2]
    s = bm.state_slots.stats()
    assert s["state_checkpoint_hits"] == 1 and s["state_checkpoints_used"] == 1
    bm.check_invariants([b])


def test_restore_copies_the_checkpoint_into_the_slot():
    bm = cached_manager()
    a = seq_of(0, range(1, 11))
    run_prefill(bm, a, fill=100.0)        # saved state: 108 everywhere
    bm.free(a)
    b = seq_of(1, range(1, 11))
    hits = bm.match_prefix(b)
    bm.allocate(b, hits)
    for t in bm.state_slots.tensors:
        assert torch.all(t[b.state_slot] == 108.0)
    assert b.num_computed_tokens == 8


def test_shared_prefix_is_checkpointed_by_the_second_request():
    """Prompts sharing 8 tokens then diverging: the first checkpoints only its own last block
    (no hit for the second); the second splits its prefill at the shared end (8) and checkpoints
    it; the third hits those 2 blocks."""
    bm = cached_manager(num_checkpoints=4)
    shared = list(range(1, 9))
    a, b, c = (seq_of(i, shared + [50 + i] * 6) for i in range(3))
    assert run_prefill(bm, a, 0.0) == ([], [12, 2])
    hits, chunks = run_prefill(bm, b, 0.0)
    assert hits == [] and chunks == [8, 4, 2]
    hits, chunks = run_prefill(bm, c, 0.0)
    assert len(hits) == 2 and chunks == [4, 2]
    assert bm.state_slots.stats()["state_checkpoint_hits"] == 1
    bm.check_invariants([a, b, c])


def test_a_short_tail_past_the_last_target_is_not_checkpointed():
    """The default rule: a prompt's last full block is a target only 2 blocks or more past the
    target before it. A shared 8-token prefix plus a 6-token tail: the second request cuts at
    the shared end (8) and then runs its 6 tokens as one chunk (not 4 + 2); the third hits the
    shared end and prefills its tail in one step. A long tail (3 blocks past) still saves."""
    bm = cached_manager(num_checkpoints=4, min_tail_blocks=2)
    shared = list(range(1, 9))
    a, b, c = (seq_of(i, shared + [50 + i] * 6) for i in range(3))
    assert run_prefill(bm, a, 0.0) == ([], [12, 2])          # 3 blocks past token 0: saved
    hits, chunks = run_prefill(bm, b, 0.0)
    assert hits == [] and chunks == [8, 6]
    hits, chunks = run_prefill(bm, c, 0.0)
    assert len(hits) == 2 and chunks == [6]
    bm.free(a)                                               # three state slots
    d = seq_of(3, shared + [60] * 13)                        # last full block 3 past the hit
    hits, chunks = run_prefill(bm, d, 0.0)
    assert len(hits) == 2 and chunks == [12, 1]
    s = bm.state_slots.stats()
    assert s["state_checkpoint_hits"] == 2 and s["state_checkpoint_saves"] == 3, s
    bm.check_invariants([b, c, d])
    with pytest.raises(ValueError, match="min_tail_blocks"):
        BlockManager(4, 4, min_tail_blocks=0)


def test_a_failed_step_saves_no_checkpoint():
    bm = cached_manager()
    a = seq_of(0, range(1, 11))
    bm.allocate(a, bm.match_prefix(a))
    bm.begin_step()
    n = bm.align_chunk(a, 10)
    bm.commit(a, n)
    bm.discard_step_hashes()           # the step failed
    bm.end_step()
    assert bm.state_slots.stats()["state_checkpoints_used"] == 0
    bm.free(a)
    bm.check_invariants([], between_steps=True)


def test_checkpoints_die_with_their_block_and_on_reset():
    """Evicting the cached block a checkpoint belongs to drops it (the hit falls back to the
    longest prefix that still has one); reset_prefix_cache forgets them all; with more prefixes
    than checkpoints the least recently used checkpoint goes."""
    bm = cached_manager(num_checkpoints=2, num_blocks=6)
    a = seq_of(0, range(1, 10))              # 9 tokens: checkpoint after 8
    run_prefill(bm, a, 0.0)
    bm.free(a)
    assert bm.state_slots.stats()["state_checkpoints_used"] == 1
    big = seq_of(1, range(60, 80))           # 20 tokens, 5 blocks: evicts a's cached blocks
    bm.allocate(big, [])
    assert bm.state_slots.stats()["state_checkpoints_used"] == 0
    bm.check_invariants([big])
    bm.free(big)
    for i, base in enumerate((20, 40, 60)):  # three prefixes, two checkpoints
        s = seq_of(10 + i, range(base, base + 5))
        run_prefill(bm, s, 0.0)
        bm.free(s)
    st = bm.state_slots.stats()
    assert st["state_checkpoints_used"] == 2 and st["state_checkpoint_evictions"] >= 1
    assert bm.match_prefix(seq_of(20, range(20, 25))) == []         # the oldest lost its state
    assert len(bm.match_prefix(seq_of(21, range(60, 65)))) == 1
    bm.reset_prefix_cache()
    assert bm.state_slots.stats()["state_checkpoints_used"] == 0
    assert bm.match_prefix(seq_of(22, range(60, 65))) == []
    bm.check_invariants([])


def test_no_checkpoints_means_no_hits():
    """num_checkpoints=0: KV blocks are still registered, but no hit is usable without the
    state at its end, so every prompt computes from token 0."""
    bm = cached_manager(num_checkpoints=0)
    a = seq_of(0, range(1, 10))
    run_prefill(bm, a, 0.0)
    bm.free(a)
    assert bm.match_prefix(seq_of(1, range(1, 10))) == []
    with pytest.raises(ValueError, match="num_checkpoints must be >= 0"):
        StateSlots(2, [torch.zeros(2, 1)], 4, -1)


def test_release_and_restore_checkpoint_memory():
    slots = StateSlots(2, [torch.zeros(2, 4)], 16, num_checkpoints=3)
    assert slots.release_checkpoints() == 3 * 4 * 4
    slots.restore_checkpoints()
    assert slots.checkpoint_tensors[0].shape == (3, 4)
    assert torch.all(slots.checkpoint_tensors[0] == 0)
