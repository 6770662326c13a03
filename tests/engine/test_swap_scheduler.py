"""Scheduler + Swapper + OffloadManager with a fake model that writes known KV values.

The fake model writes token_id * 1000 + position into every slot it computes and, before each
step, checks that every computed slot of every scheduled sequence still holds its value: any
swap that lost, misplaced or corrupted KV fails the run. Tokens follow a fixed rule from the last
token, so the outputs must not depend on preemption either.
"""
import pytest
import torch

from cb_kernels.engine.block_manager import BlockManager
from cb_kernels.engine.config import SamplingParams
from cb_kernels.engine.offload import OffloadManager
from cb_kernels.engine.preemption import PreemptionPolicy
from cb_kernels.engine.scheduler import Scheduler
from cb_kernels.engine.sequence import Sequence, SequenceStatus
from cb_kernels.engine.swapper import Swapper

BLOCK_SIZE, NUM_LAYERS = 4, 2


class FakeRun:
    def __init__(self, num_blocks, num_host_blocks, mode, swap_fn=None, prefix_caching=True,
                 max_batch_tokens=32):
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, prefix_caching)
        self.caches = [torch.full((num_blocks, BLOCK_SIZE, 1, 2), float("nan"))
                       for _ in range(2 * NUM_LAYERS)]
        self.offload = OffloadManager(self.caches, num_host_blocks, swap_fn=swap_fn)
        swapper = Swapper(self.bm, self.offload, PreemptionPolicy(mode))
        self.sched = Scheduler(self.bm, max_batch_tokens, 8, swapper=swapper)
        self.done = {}
        self.errors = {}

    def add(self, seq_id, prompt, max_new):
        seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_new_tokens=max_new))
        self.sched.add(seq)

    def value(self, seq, p):
        return float(seq.token_ids[p] * 1000 + p)

    def slot_values(self, seq, p):
        b, o = seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE
        return [c[b, o, 0, 0].item() for c in self.caches]

    def step(self):
        batch = self.sched.schedule()
        for seq in batch.failed:
            self.errors[seq.request_id] = seq.error
        for src, dst in batch.blocks_to_copy:
            for c in self.caches:
                c[dst] = c[src]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for p in range(seq.num_computed_tokens):
                assert self.slot_values(seq, p) == [self.value(seq, p)] * len(self.caches), \
                    f"{seq}: KV of position {p} lost"
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                b, o = seq.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE
                for c in self.caches:
                    c[b, o] = self.value(seq, p)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                token = (seq.token_ids[-1] * 7 + 3) % 101
                seq.token_ids.append(token)
                if seq.check_stop(token):
                    self.done[seq.request_id] = seq.output_token_ids
                    self.sched.finish(seq)
        self.check()
        return batch

    def check(self):
        self.bm.check_invariants(self.sched.seqs_holding_blocks())
        self.sched.swapper.check_invariants(self.sched.swapped)

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.bm.num_used_blocks == 0 and self.offload.host_used_blocks == 0
        return self.done


def workload(run, shared_prefix=False):
    for i in range(10):
        prompt = [(i * 13 + j) % 97 + 1 for j in range(5 + 3 * i)]
        if shared_prefix:
            prompt = [50, 51, 52, 53] + prompt
        run.add(i, prompt, 8 + 3 * (i % 4))


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["distinct", "shared-prefix"])
def test_same_tokens_under_swap_and_recompute(shared_prefix):
    results, stats = {}, {}
    for name, num_blocks, host, mode in [("roomy", 200, 0, "recompute"), ("swap", 12, 64, "swap"),
                                         ("recompute", 12, 0, "recompute"),
                                         ("host-exhausted", 12, 5, "swap"), ("auto", 12, 64, "auto")]:
        run = FakeRun(num_blocks, host, mode)
        workload(run, shared_prefix)
        results[name] = run.run()
        stats[name] = (run.offload.swaps_out, run.offload.swaps_in, run.sched.num_recomputes)
    for name in results:
        assert results[name] == results["roomy"], name
    assert stats["roomy"] == (0, 0, 0)
    assert stats["swap"][0] > 0 and stats["swap"][0] == stats["swap"][1]
    assert stats["recompute"][0] == 0 and stats["recompute"][2] > 0
    assert stats["host-exhausted"][0] > 0 and stats["host-exhausted"][2] > 0
    assert stats["auto"][0] > 0


def test_all_shared_victim_is_skipped():
    """b is a fork of a (every block shared): preempting either frees nothing, so the victim is
    c, the only one with blocks of its own; the run then finishes without looping."""
    run = FakeRun(9, 16, "swap", max_batch_tokens=64)
    bm, sched = run.bm, run.sched
    c = Sequence(0, "c", [9, 8, 7, 6, 5], SamplingParams(max_new_tokens=12))
    a = Sequence(1, "a", list(range(1, 9)), SamplingParams(max_new_tokens=12))
    sched.add(c)
    sched.add(a)
    run.step()
    b = Sequence(2, "b", a.prompt_token_ids, SamplingParams(max_new_tokens=12))
    b.token_ids = list(a.token_ids)
    bm.fork(a, b)
    b.status = SequenceStatus.RUNNING
    sched.running.append(b)
    swapper = sched.swapper
    assert swapper.freed_blocks(a) == swapper.freed_blocks(b) == 0 < swapper.freed_blocks(c)
    assert sched._pick_victim(0) is c
    assert swapper.choose(b) == "recompute" and swapper.choose(c) == "swap"
    run.check()
    done = run.run()
    assert done["a"] == done["b"] and len(done) == 3


def failing_swap(fail_on):
    calls = {"n": 0}

    def swap(src, dst, mapping, stream=None):
        calls["n"] += 1
        if calls["n"] == fail_on:
            raise RuntimeError("injected")
        for s, d in mapping.tolist():
            for x, y in zip(src, dst):
                y[d].copy_(x[s])
    return swap


@pytest.mark.parametrize("fail_on", [1, 2], ids=["swap-out", "swap-in"])
def test_injected_failure_fails_one_request_and_leaks_nothing(fail_on):
    run = FakeRun(12, 64, "swap", swap_fn=failing_swap(fail_on))
    workload(run)
    done = run.run()
    assert len(run.errors) == 1 and "injected" in next(iter(run.errors.values()))
    assert len(done) == 9 and not set(done) & set(run.errors)
    ref = FakeRun(200, 0, "recompute")
    workload(ref)
    want = ref.run()
    for rid, tokens in done.items():
        assert tokens == want[rid]
