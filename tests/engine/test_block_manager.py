"""BlockManager without a model: ref counts, prefix caching, LRU eviction, copy-on-write."""
import subprocess
import sys

import pytest

from cb_kernels.engine.block_manager import BlockManager, hash_block
from cb_kernels.engine.config import SamplingParams
from cb_kernels.engine.sequence import Sequence

_next = [0]


def seq_of(tokens, max_new=4):
    _next[0] += 1
    return Sequence(_next[0], f"r{_next[0]}", tokens, SamplingParams(max_new_tokens=max_new))


def admit(bm, seq):
    hits = bm.match_prefix(seq)
    assert bm.can_allocate(seq, hits)
    bm.allocate(seq, hits)
    bm.commit(seq, seq.num_tokens)       # the step computing them is scheduled
    return hits


def test_allocate_free_counts_and_invariants():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a, b = seq_of(list(range(1, 10))), seq_of(list(range(1, 5)))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 6
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10 and bm.num_cached_blocks == 0
    bm.check_invariants([])


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(list(range(1, 10)))            # 9 tokens: 3 blocks, 2 full
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 3
    b = seq_of(list(range(1, 9)) + [99] * 5)  # shares 2 full blocks, needs 4 blocks in all
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, hits)       # 2 new blocks, but only 1 is not a hit
    c = seq_of(list(range(1, 9)) + [99])      # needs 3 blocks: 2 hits + 1 new
    assert bm.can_allocate(c, bm.match_prefix(c))


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 108))            # two full blocks
    a = seq_of(system + [1, 2, 3])
    assert admit(bm, a) == []
    b = seq_of(system + [7])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == 8 and b.metrics.num_cached_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.check_invariants([a, b])
    exact = seq_of(list(system))              # the whole prompt is cached: last block recomputed
    hits = admit(bm, exact)
    assert len(hits) == 1 and exact.num_computed_tokens == 4
    bm.check_invariants([a, b, exact])
    for s in (a, b, exact):
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0


def test_hash_is_chained_and_stable_across_processes():
    h1 = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == h1
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    code = ("from cb_kernels.engine.block_manager import hash_block;"
            "print(hash_block(hash_block(b'', [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin",
                                "PYTHONPATH": ":".join(sys.path)}).stdout.strip()
            for seed in ("12345",)}
    assert outs == {hash_block(h1, [5, 6, 7, 8]).hex()}


def test_lru_evicts_least_recently_freed_and_tail_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq_of([1, 2, 3, 4, 5]), seq_of([9, 8, 7, 6, 5])
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # Freed blocks return tail first; a's full blocks were freed before b's.
    assert list(bm.cached_lru) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    c = seq_of([50, 51, 52, 53, 54, 55, 56, 57, 58])    # needs 5 blocks: 2 free + 3 evicted
    admit(bm, c)
    assert bm.num_evicted_blocks == 3
    assert bm.match_prefix(seq_of([1, 2, 3, 4, 5])) == []           # a's head got evicted
    assert bm.match_prefix(seq_of([9, 8, 7, 6, 5])) == [b_blocks[0]]  # b's head survived
    bm.check_invariants([c])


def test_fork_copy_on_write_of_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq_of([1, 2, 3, 4, 5, 6])
    admit(bm, parent)
    parent.num_computed_tokens = 6
    child = seq_of([1, 2, 3, 4, 5, 6])
    bm.fork(parent, child)
    assert bm.ref_counts[parent.block_table[1]] == 2
    bm.check_invariants([parent, child])
    child.token_ids.append(42)                 # the child decodes into the shared block
    assert bm.can_append(child)
    copies = bm.append_slot(child)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]   # full block stays shared
    parent.token_ids.append(43)
    assert bm.append_slot(parent) == []        # now the parent owns its block alone
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    bm.check_invariants([])


def test_append_slot_takes_a_block_at_the_boundary_and_can_append_says_so():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq_of([1, 2, 3])
    admit(bm, a)
    a.num_computed_tokens = 3
    a.token_ids.append(4)
    assert bm.can_append(a) and bm.append_slot(a) == []      # slot 4 is in block 1
    a.num_computed_tokens = 4
    a.token_ids.append(5)
    assert not bm.can_append(a)                               # needs a third block
    bm.check_invariants([a])


def test_discard_step_hashes_forgets_unwritten_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    bm.begin_step()
    admit(bm, a)
    assert len(bm.hash_to_block) == 2
    bm.discard_step_hashes()
    bm.free(a)
    assert bm.hash_to_block == {} and bm.num_cached_blocks == 0
    bm.check_invariants([])


def test_check_invariants_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq_of([1, 2, 3])
    admit(bm, a)
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_invariants([])
    bm.ref_counts[a.block_table[0]] += 1
    with pytest.raises(AssertionError):
        bm.check_invariants([a])


def test_pending_hashes_are_caught_and_dropped_by_the_next_step():
    """Hashes of a step that neither ended nor was discarded (interrupted) are pending: the
    between-steps check refuses them and the next begin_step() drops them."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq_of([1, 2, 3, 4, 5])
    bm.begin_step()
    admit(bm, a)
    bm.check_invariants([a])                          # inside the step: fine
    with pytest.raises(AssertionError, match="never completed"):
        bm.check_invariants([a], between_steps=True)
    bm.free(a)
    bm.begin_step()
    assert bm.hash_to_block == {} and bm.num_cached_blocks == 0
    b = seq_of([1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == []
    admit(bm, b)
    bm.end_step()
    bm.check_invariants([b], between_steps=True)
    assert len(bm.hash_to_block) == 2


def test_reset_prefix_cache_frees_cached_blocks_and_stops_old_sequences():
    bm = BlockManager(num_blocks=12, block_size=2)
    old, done = seq_of([1, 2, 3, 4, 5]), seq_of([7, 8, 9, 10, 11])
    admit(bm, old)
    admit(bm, done)
    bm.free(done)
    assert bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {} and bm.num_cached_blocks == 0 and bm.epoch == 1
    bm.check_invariants([old])
    old.token_ids += [6, 7, 8]                       # it keeps running on its old KV ...
    bm.append_slot(old)
    bm.commit(old, 8)
    assert bm.hash_to_block == {}                    # ... but never shares a block of it
    new = seq_of([1, 2, 3, 4, 5])
    assert bm.match_prefix(new) == []
    admit(bm, new)
    assert len(bm.hash_to_block) == 2 and new.kv_epoch == 1
    bm.check_invariants([old, new])
