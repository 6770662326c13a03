"""Device KV blocks: reference counts, prefix caching and copy-on-write.

Every block is in exactly one of three states:
  used    ref_count > 0 (owned by one or more sequences' block tables)
  cached  ref_count == 0 and its hash is registered: its KV is kept for a future prefix hit and
          is evicted lazily, least recently freed first, when a fresh block is needed
  free    ref_count == 0 and no hash
so free + used + cached == num_blocks, which check_invariants() proves.

Prefix hashes form a chain over full blocks: hash_i = blake2b(hash_{i-1} || token ids of block i)
with the ids as little-endian int64. It is stable across processes (unlike Python's salted
hash()), and a 128-bit digest makes a collision negligible, so hits are not re-compared token by
token. A block's hash is registered when the step that computes its last token is scheduled:
write_kv of every layer runs for the whole batch before that layer's attention, so a request
admitted in the same step may already read it. Until the engine says that step was issued
(`end_step`) its hashes are pending: a step that fails or is interrupted, with any exception,
drops them (`discard_step_hashes`, also done by the next `begin_step` if the engine never could),
since their KV may never have been written; `check_invariants` refuses pending hashes between
steps.

Weights: KV depends on the weights that computed it. `reset_prefix_cache()` (the engine calls it
when the model's weights change) forgets every hash, frees the cached blocks and starts a new
`epoch`; a sequence whose KV is older than the epoch (`Sequence.kv_epoch`) never registers a
block again until it is recomputed, so no request can reuse KV of the old weights.

Stateful layers (hybrid models, engine/state_slots.py): a cached prefix is usable only with the
state those layers had after its last token, so a hit is cut back to the longest prefix whose
last block has a state checkpoint (none: the prompt is computed from token 0, its KV blocks
then its own). Checkpoints are taken at chosen block boundaries of a prefill, its *targets*:
  * the end of the KV prefix this prompt shares with earlier ones beyond its last checkpoint:
    the second request with a system prompt checkpoints it, every later one hits it;
  * the last full block of the prompt that a later request could hit (the prompt minus its last
    token), for a second round of the same prompt, a fork waiting for a seat or a recompute,
    when it lies at least `min_tail_blocks` (2) blocks past the target before it (the hit or
    the shared end): a shorter tail would cost this prefill a step of its own to save a later
    hit the recompute of one block, which that hit does inside its one prefill step anyway.
    (A 512-token system prompt hit with a 32-token tail: 16 + 16 tokens in two steps, 18.1 ms
    to the first token in bf16 on the Qwen3-Next hd128 shape, where one step suffices.)
The scheduler cuts a prefill chunk so that it ends on its next target (`align_chunk`); the
step that reaches a target saves the slot into a checkpoint once it was issued (`end_step`),
and a failed step saves nothing. A checkpoint dies with its block (eviction, reset).
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque

from cb_kernels.engine.sequence import PLACEHOLDER, Sequence

_NO_HASH = b""
_NO_COPIES: list = []      # shared, never mutated


def hash_block(parent: bytes, token_ids) -> bytes:
    """Chained prefix hash of one full block (`parent` is b"" for the first block)."""
    data = array("q", token_ids)
    if sys.byteorder != "little":
        data.byteswap()
    return hashlib.blake2b(parent + data.tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 min_tail_blocks: int = 2):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if min_tail_blocks < 1:
            raise ValueError(f"min_tail_blocks must be >= 1, got {min_tail_blocks}")
        # A prompt's last full block is a checkpoint target only this many blocks past the
        # target before it (module docstring).
        self.min_tail_blocks = min_tail_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash = [_NO_HASH] * num_blocks
        self.hash_to_block: dict = {}
        self.free_ids = deque(range(num_blocks))
        self.cached_lru: OrderedDict = OrderedDict()   # block id -> None, oldest first
        self.registered_this_step: list = []     # pending: KV not known to be written yet
        self.epoch = 0
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.num_prefix_resets = 0
        # Models with stateful layers: the state slot every block-holding sequence owns, taken
        # and returned with its blocks (engine/state_slots.py); None otherwise.
        self.state_slots = None
        self._targets: dict = {}                 # seq_id -> token counts to checkpoint at
        self._saves_this_step: list = []         # (seq, block hash): saved at end_step

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take now (free plus evictable cached ones)."""
        return len(self.free_ids) + len(self.cached_lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids) - len(self.cached_lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def _hashes_upto(self, seq: Sequence, num_full_blocks: int) -> list:
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if i else _NO_HASH, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> list:
        """Block ids holding the longest cached prefix of `seq`. At least one token is always
        left to compute, since the step must produce the logits of the last one."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes_upto(seq, (seq.num_tokens - 1) // self.block_size)
        hits = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        if self.state_slots is not None:       # usable only up to a state checkpoint
            has = self.state_slots.has_checkpoint
            while hits and not has(hashes[len(hits) - 1]):
                hits.pop()
        return hits

    def _set_targets(self, seq: Sequence, num_hits: int) -> None:
        """The block boundaries (token counts) where `seq`'s prefill saves its state (see the
        module docstring); `num_hits` blocks came from a checkpoint."""
        last = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes_upto(seq, last)
        shared = num_hits
        while shared < len(hashes) and hashes[shared] in self.hash_to_block:
            shared += 1
        ends = [shared] if shared > num_hits else []
        if last - max(shared, num_hits) >= self.min_tail_blocks:
            ends.append(last)
        targets = [n * self.block_size for n in ends]
        if targets:
            self._targets[seq.seq_id] = targets

    def align_chunk(self, seq: Sequence, n: int) -> int:
        """`n` new tokens for `seq`'s next prefill chunk, cut so that it ends on its next
        checkpoint target instead of running past it."""
        targets = self._targets.get(seq.seq_id)
        if targets:
            start = seq.num_computed_tokens
            for t in targets:
                if start < t < start + n:
                    return t - start
        return n

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Register the hashes of the full blocks among the first `num_tokens` tokens of `seq`
        (called when the step that computes them is scheduled). A block that holds a
        PLACEHOLDER token waits: the engine commits it again once the token is known."""
        if not self.enable_prefix_caching or seq.kv_epoch != self.epoch:
            return
        if seq.token_ids[-1] == PLACEHOLDER:
            num_tokens = min(num_tokens, len(seq.token_ids) - 1)
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes_upto(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block, h = seq.block_table[i], hashes[i]
            if h not in self.hash_to_block and self.block_hash[block] == _NO_HASH:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self.registered_this_step.append(block)
        seq.num_registered_blocks = num_full
        targets = self._targets.get(seq.seq_id)
        if targets and num_tokens in targets and hashes[num_full - 1] in self.hash_to_block:
            self._saves_this_step.append((seq, hashes[num_full - 1]))

    def discard_step_hashes(self) -> None:
        """Forget the hashes registered since the last begin_step(): that step failed, so their
        KV may never have been written."""
        for block in self.registered_this_step:
            h = self.block_hash[block]
            if h != _NO_HASH and self.hash_to_block.get(h) == block:
                self._unregister(block)
        self.registered_this_step.clear()
        self._saves_this_step.clear()

    def begin_step(self) -> None:
        # Hashes still pending here belong to a step that neither ended nor was discarded (the
        # engine was interrupted where it could not clean up): their KV may be missing.
        self.discard_step_hashes()

    def end_step(self) -> None:
        """The step scheduled since begin_step() was issued: its KV writes are ordered before
        any later read, so its hashes stop being pending; the state checkpoints it reached are
        saved (stream-ordered after its state writes)."""
        self.registered_this_step.clear()
        for seq, h in self._saves_this_step:
            if seq.state_slot >= 0 and h in self.hash_to_block:
                self.state_slots.save(seq, h)
        self._saves_this_step.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (the weights changed): cached blocks become free, used
        blocks keep their KV for their owners only, and sequences holding KV of the old epoch
        register nothing more."""
        for block in list(self.hash_to_block.values()):
            self._unregister(block)
        self.registered_this_step.clear()
        self._saves_this_step.clear()
        if self.state_slots is not None:
            self.state_slots.clear()
        self.epoch += 1
        self.num_prefix_resets += 1

    def _unregister(self, block: int) -> None:
        self._forget(self.block_hash[block])
        self.block_hash[block] = _NO_HASH
        if block in self.cached_lru:
            del self.cached_lru[block]
            self.free_ids.append(block)

    # -- allocation -----------------------------------------------------------------------------
    def _take_block(self) -> int:
        if self.free_ids:
            block = self.free_ids.popleft()
        else:
            block, _ = self.cached_lru.popitem(last=False)
            self._forget(self.block_hash[block])
            self.block_hash[block] = _NO_HASH
            self.num_evicted_blocks += 1
        self.ref_counts[block] = 1
        return block

    def _forget(self, h: bytes) -> None:
        del self.hash_to_block[h]
        if self.state_slots is not None:
            self.state_slots.drop(h)

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.cached_lru[block]
        self.ref_counts[block] += 1

    def can_allocate(self, seq: Sequence, hits: list, reserve: int = 0) -> bool:
        """Whether `seq` (holding no blocks) can get blocks for all its tokens, reusing `hits`
        and leaving `reserve` blocks available for the decodes of running requests."""
        if self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        needed = self.blocks_for(seq.num_tokens) - len(hits)
        return needed + reserve <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, hits: list) -> None:
        """Give `seq` blocks for all its tokens; the `hits` prefix is already computed."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block in hits:
            self._ref(block)
        table = list(hits)
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            table.append(self._take_block())
        seq.block_table = table
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.kv_epoch = self.epoch
        seq.metrics.num_cached_tokens = seq.num_computed_tokens
        self.num_hit_blocks += len(hits)
        if self.state_slots is not None:
            self.state_slots.allocate(seq)
            if hits:
                self.state_slots.restore(seq, seq.block_hashes[len(hits) - 1])
            if self.enable_prefix_caching:
                self._set_targets(seq, len(hits))

    def _needs_new_block(self, seq: Sequence) -> bool:
        last = (seq.num_tokens - 1) // self.block_size    # block of the token written next
        return last >= len(seq.block_table) or self.ref_counts[seq.block_table[last]] > 1

    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot of `seq`'s next token can be provided without preempting."""
        return not self._needs_new_block(seq) or self.num_free_blocks >= 1

    def try_append_slot(self, seq: Sequence):
        """can_append + append_slot in one pass (the scheduler's hot path): the copy-on-write
        pairs, or None when a block is needed and none is available."""
        last = (len(seq.token_ids) - 1) // self.block_size
        table = seq.block_table
        if last < len(table) and self.ref_counts[table[last]] == 1:
            return _NO_COPIES
        if not self.free_ids and not self.cached_lru:
            return None
        return self.append_slot(seq)

    def append_slot(self, seq: Sequence) -> list:
        """Make room for the KV of `seq`'s last token; returns the (src, dst) block copies that
        copy-on-write needs (a partial last block shared after fork())."""
        last = (seq.num_tokens - 1) // self.block_size
        if last >= len(seq.block_table):
            assert last == len(seq.block_table), f"{seq} skipped a block"
            seq.block_table.append(self._take_block())
            return _NO_COPIES
        old = seq.block_table[last]
        if self.ref_counts[old] == 1:
            return _NO_COPIES
        new = self._take_block()
        self.ref_counts[old] -= 1
        seq.block_table[last] = new
        return [(old, new)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks; a shared partial block is copied when either
        writes into it (append_slot)."""
        for block in parent.block_table:
            self._ref(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.kv_epoch = parent.kv_epoch
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks. Last blocks first, so the LRU evicts a request's tail before
        its more shareable head."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] != _NO_HASH:
                    self.cached_lru[block] = None
                else:
                    self.free_ids.append(block)
        seq.block_table = []
        seq.num_registered_blocks = 0
        if self.state_slots is not None:
            self.state_slots.free(seq)
            self._targets.pop(seq.seq_id, None)

    # -- checks ---------------------------------------------------------------------------------
    def check_invariants(self, seqs, between_steps: bool = False) -> None:
        """Raise AssertionError unless the counts and ref counts match the owners in `seqs`
        (every sequence that holds device blocks); `between_steps` (the engine's check): no hash
        is pending either."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} repeats a block"
            assert len(seq.block_table) >= self.blocks_for(seq.num_computed_tokens), \
                f"{seq} has computed tokens outside its blocks"
            for block in seq.block_table:
                owners[block] += 1
        assert owners == self.ref_counts, "ref counts differ from block-table owners: " + str(
            [(b, o, r) for b, (o, r) in enumerate(zip(owners, self.ref_counts)) if o != r][:8])
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        cached = set(self.cached_lru)
        assert not free & cached, "a block is both free and cached"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not used & (free | cached), "a referenced block is free or cached"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + used {len(used)} != {self.num_blocks}")
        for b in free:
            assert self.block_hash[b] == _NO_HASH, f"free block {b} keeps a hash"
        for b in cached:
            assert self.block_hash[b] != _NO_HASH, f"cached block {b} has no hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
        assert sum(1 for h in self.block_hash if h != _NO_HASH) == len(self.hash_to_block), \
            "a block keeps a hash the map does not know"
        pending = [b for b in self.registered_this_step if self.block_hash[b] != _NO_HASH]
        if self.state_slots is not None:
            self.state_slots.check_invariants(seqs)
            for h in self.state_slots.checkpoint_hashes():
                assert h in self.hash_to_block, "a state checkpoint outlived its block"
        assert not (between_steps and pending), (
            f"blocks {pending[:8]} keep hashes of a step that never completed (their KV may never "
            "have been written)")
