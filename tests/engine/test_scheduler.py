"""Scheduler without a model: token budget, decode-first order, admission, preemption, progress."""
import random

import pytest

from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import SamplingParams
from cb_kernels.engine.scheduler import Scheduler
from cb_kernels.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_batch_tokens=32, max_num_seqs=8, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_batch_tokens, max_num_seqs, watermark=0.0)


def add(sched, n_prompt, max_new=4, first_token=1):
    sid = len(sched.running) + len(sched.waiting) + sched.num_added
    sched.num_added += 1
    seq = Sequence(sid, f"r{sid}", list(range(first_token, first_token + n_prompt)),
                   SamplingParams(max_new_tokens=max_new))
    sched.add(seq)
    return seq


@pytest.fixture(autouse=True)
def _counter(monkeypatch):
    monkeypatch.setattr(Scheduler, "num_added", 0, raising=False)


def fake_step(sched, batch, token=7):
    """What the engine's postprocess does, with a constant sampled token."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)
            if seq.check_stop(token):
                sched.finish(seq)
                finished.append(seq)
    return finished


def test_budget_shared_decodes_first_then_chunks():
    s = make(max_batch_tokens=16)
    a = add(s, 3)
    fake_step(s, s.schedule())                       # a prefilled, now decoding
    b = add(s, 40)
    batch = s.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 15
    fake_step(s, batch)
    c = add(s, 5, first_token=100)
    batch = s.schedule()                             # a decodes, b continues: no room for c
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15] and list(s.waiting) == [c]
    fake_step(s, batch)
    batch = s.schedule()                             # b's last 10 tokens, then c's 5
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [1, 10, 5]


def test_admission_stops_at_first_request_that_does_not_fit_and_respects_max_num_seqs():
    s = make(num_blocks=6, block_size=4, max_batch_tokens=64, max_num_seqs=2)
    a, b, c = add(s, 12), add(s, 16, first_token=50), add(s, 2, first_token=90)
    batch = s.schedule()
    assert batch.seqs == [a]                         # b needs 4 blocks, 3 are left: c waits too
    assert list(s.waiting) == [b, c]
    s2 = make(max_batch_tokens=64, max_num_seqs=2)
    for _ in range(3):
        add(s2, 2)
    assert len(s2.schedule().seqs) == 2


def test_preemption_picks_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=2, max_batch_tokens=32, prefix=False)
    a, b = add(s, 3, max_new=8), add(s, 3, max_new=8)
    fake_step(s, s.schedule())                       # both prefilled: 2 + 2 blocks, none free
    batch = s.schedule()                             # a's next token fits its block, b's too
    assert batch.seqs == [a, b]
    fake_step(s, batch)
    batch = s.schedule()                             # both need a third block: b is preempted
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b and not b.block_table
    assert s.num_recomputes == 1 and b.metrics.num_preemptions == 1
    s.block_manager.check_invariants(s.running)


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=3, block_size=2, max_batch_tokens=32, prefix=False)
    a = add(s, 4, max_new=8)
    b = add(s, 1, max_new=8)
    fake_step(s, s.schedule())
    fake_step(s, s.schedule())
    # a holds 3 blocks (5 tokens + next), b would need a block: b is the newest, so b yields.
    while b.status is SequenceStatus.RUNNING:
        fake_step(s, s.schedule())
    assert a.status is SequenceStatus.RUNNING and s.num_recomputes >= 1
    s.block_manager.check_invariants(s.running)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])
def test_every_request_finishes_under_a_tiny_pool(prefix):
    rng = random.Random(0)
    s = make(num_blocks=12, block_size=4, max_batch_tokens=20, max_num_seqs=6, prefix=prefix)
    seqs = []
    for _ in range(60):
        n, new = rng.randint(1, 20), rng.randint(1, 24)
        assert s.block_manager.blocks_for(n + new - 1) <= 12   # what add_request guarantees
        seqs.append(add(s, n, max_new=new, first_token=rng.choice([1, 1, 50])))
    steps = 0
    while s.has_unfinished():
        batch = s.schedule()
        assert batch.seqs, "nothing scheduled while requests wait"
        assert batch.num_tokens <= 20 and len(s.running) <= 6
        fake_step(s, batch)
        s.block_manager.check_invariants(s.running)
        steps += 1
        assert steps < 5000
    assert all(seq.num_generated_tokens == seq.params.max_new_tokens for seq in seqs)
    assert s.block_manager.num_used_blocks == 0
    assert s.num_recomputes > 0


def test_prefix_hits_within_the_same_step():
    s = make(num_blocks=32, block_size=4, max_batch_tokens=64)
    a, b = add(s, 9), add(s, 9)                     # identical prompts
    batch = s.schedule()
    assert batch.seqs == [a, b]
    assert b.block_table[:2] == a.block_table[:2] and batch.num_new_tokens == [9, 1]
    s.block_manager.check_invariants(s.running)
