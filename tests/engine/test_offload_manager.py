"""OffloadManager, PreemptionPolicy and StreamOrchestrator without a model (pure bookkeeping + copies)."""
import logging

import pytest
import torch

from cb_kernels.engine.offload import OffloadError, OffloadManager
from cb_kernels.engine.preemption import PreemptionPolicy, pick_victim
from cb_kernels.engine.streams import StreamOrchestrator

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 11, 4, 2, 6


def device_pool(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * NUM_LAYERS)]


def manager(caches, num_host_blocks, swap_fn=None):
    return OffloadManager(caches, num_host_blocks, swap_fn=swap_fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_round_trip_bit_exact(dtype):
    caches = device_pool(dtype)
    m = manager(caches, 7)
    blocks = [9, 2, 5]  # shuffled, non-contiguous
    saved = [c[blocks].clone() for c in caches]
    host = m.swap_out("a", blocks)
    assert len(host) == 3 and m.host_used_blocks == 3
    for c in caches:
        c[blocks] = float("nan")
    new_blocks = [0, 10, 4]
    m.swap_in("a", new_blocks)
    for c, s in zip(caches, saved):
        assert torch.equal(c[new_blocks], s)
    assert m.host_used_blocks == 0 and not m.holds("a")
    st = m.stats()
    assert st["swaps_out"] == 1 and st["swaps_in"] == 1
    assert st["swap_bytes"] == 6 * m.block_bytes
    assert m.block_bytes == 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * caches[0].element_size()
    m.check_invariants()


def test_many_requests_interleaved():
    caches = device_pool()
    m = manager(caches, 6)
    snap = {rid: [c[b].clone() for c in caches] for rid, b in (("a", [1, 2]), ("b", [3, 4, 5]))}
    m.swap_out("a", [1, 2]); m.swap_out("b", [3, 4, 5])
    assert not m.can_swap_out(2) and m.can_swap_out(1)
    m.check_invariants()
    m.swap_in("a", [7, 8])
    m.swap_out("c", [0, 6])  # reuses a's freed host blocks
    m.swap_in("b", [9, 10, 1])
    for c, s in zip(caches, snap["a"]):
        assert torch.equal(c[[7, 8]], s)
    for c, s in zip(caches, snap["b"]):
        assert torch.equal(c[[9, 10, 1]], s)
    m.free("c")
    assert m.host_used_blocks == 0
    m.check_invariants()


def test_bad_calls_raise_and_keep_state():
    m = manager(device_pool(), 2)
    with pytest.raises(ValueError, match="free blocks"):
        m.swap_out("a", [1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        m.swap_out("a", [])
    m.swap_out("a", [1])
    with pytest.raises(ValueError, match="already swapped"):
        m.swap_out("a", [2])
    with pytest.raises(ValueError, match="holds 1"):
        m.swap_in("a", [1, 2])
    with pytest.raises(ValueError, match="no host blocks"):
        m.swap_in("zz", [1])
    with pytest.raises(ValueError, match="num_host_blocks"):
        manager(device_pool(), -1)
    m.check_invariants()
    assert m.host_used_blocks == 1


def failing_after(n):
    calls = []

    def swap(src, dst, mapping, stream=None):
        calls.append(mapping.shape[0])
        if len(calls) > n:
            raise RuntimeError("injected transfer failure")
        for s, d in mapping.tolist():
            for a, b in zip(src, dst):
                b[d].copy_(a[s])
    return swap


@pytest.mark.parametrize("fail_at", ["out", "in"])
def test_transfer_failure_leaks_nothing(fail_at):
    m = manager(device_pool(), 5, swap_fn=failing_after(0 if fail_at == "out" else 1))
    if fail_at == "out":
        with pytest.raises(OffloadError, match="swap-out of request 'a' failed: injected"):
            m.swap_out("a", [1, 2, 3])
    else:
        m.swap_out("a", [1, 2, 3])
        with pytest.raises(OffloadError, match="swap-in of request 'a' failed"):
            m.swap_in("a", [4, 5, 6])
    assert m.host_used_blocks == 0 and not m.holds("a")
    assert m.stats()["swap_failures"] == 1
    m.check_invariants()


def test_check_invariants_catches_corruption():
    m = manager(device_pool(), 3)
    m.swap_out("a", [1])
    m._free.append(m._owned["a"][0])
    with pytest.raises(AssertionError, match="host pool broken"):
        m.check_invariants()


def test_policy_modes():
    kw = dict(num_tokens=100, swap_blocks=4, freed_blocks=4, block_bytes=1 << 20, host_free_blocks=10)
    assert PreemptionPolicy("swap").choose(**kw) == "swap"
    assert PreemptionPolicy("recompute").choose(**kw) == "recompute"
    assert PreemptionPolicy("swap").choose(**{**kw, "host_free_blocks": 3}) == "recompute"
    assert PreemptionPolicy("swap").choose(**{**kw, "swap_blocks": 0}) == "recompute"
    assert PreemptionPolicy("swap").choose(**{**kw, "freed_blocks": 0}) == "recompute"
    # 8 MiB over 5 GB/s is ~1.7 ms; 100 tokens at 0.5 ms is 50 ms: swap is cheaper.
    assert PreemptionPolicy("auto").choose(**kw) == "swap"
    slow_link = PreemptionPolicy("auto", copy_bytes_per_s=1e6)
    assert slow_link.choose(**kw) == "recompute"
    with pytest.raises(ValueError, match="preemption"):
        PreemptionPolicy("sometimes")


def test_policy_learns_rates():
    p = PreemptionPolicy("auto", smoothing=1.0)
    p.record_prefill(1000, 0.001)
    p.record_copy(10 ** 9, 1.0)
    assert p.prefill_s_per_token == pytest.approx(1e-6)
    assert p.copy_bytes_per_s == pytest.approx(1e9)
    # Now prefill is nearly free: 100 tokens = 0.1 ms vs 8 MiB twice over 1 GB/s = 17 ms.
    assert p.choose(num_tokens=100, swap_blocks=4, freed_blocks=1, block_bytes=1 << 20, host_free_blocks=10) == "recompute"


def test_pick_victim_skips_all_shared():
    owned = {"a": 2, "b": 0, "c": 0}
    assert pick_victim(["a", "b", "c"], owned.get) == "a"
    assert pick_victim(["b", "c"], owned.get) == "c"
    assert pick_victim([], owned.get) is None


def test_orchestrator_cpu_is_synchronous(caplog):
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        orch = StreamOrchestrator("cpu", "on")
    assert "synchronously" in caplog.text and "requires CUDA" not in caplog.text
    assert not orch.asynchronous
    out = []
    orch.copy_in(lambda stream: out.append(stream))
    orch.copy_out(lambda stream: out.append(stream))
    assert out == [None, None]
    orch.begin_compute()
    pending = orch.tokens_to_host(torch.tensor([3, 1, 4]))
    assert pending.ready() and pending.result() == [3, 1, 4]
    assert torch.equal(orch.to_device(torch.arange(3)), torch.arange(3))
    orch.synchronize()
    for mode in ("auto", "off"):
        assert not StreamOrchestrator("cpu", mode).asynchronous
    with pytest.raises(ValueError, match="overlap"):
        StreamOrchestrator("cpu", "yes")


class _FakeStream:
    def __init__(self, name):
        self.name, self.waits = name, []

    def wait_stream(self, other):
        self.waits.append(other.name)

    def wait_event(self, event):
        self.waits.append(event.name)


def test_compute_waits_for_swaps_but_never_for_the_token_copy(monkeypatch):
    """The event bookkeeping of an asynchronous orchestrator, with stand-in streams and events:
    the next step's compute (and the other copy stream) wait for a swap's copy, never for the
    sampled tokens' copy to the host, which nothing on the device reads."""
    import contextlib

    names = iter(f"event{i}" for i in range(100))

    class Event:
        def __init__(self):
            self.name = next(names)

        def record(self, stream):
            self.stream = stream.name

        def query(self):
            return False

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    orch = StreamOrchestrator("cpu", "off")
    orch.asynchronous = True
    orch.compute, orch.h2d, orch.d2h = (_FakeStream(n) for n in ("compute", "h2d", "d2h"))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    orch.copy_out(lambda stream: None)                          # a swap-out: event0
    pending = orch.tokens_to_host(torch.tensor([3, 1, 4]))      # the sampled tokens: event1
    orch.copy_in(lambda stream: None)                           # a swap-in: event2
    orch.begin_compute()
    assert pending._event.name == "event1" and pending._host.tolist() == [3, 1, 4]
    assert orch.compute.waits == ["event0", "event2"]
    assert orch.h2d.waits == ["compute", "event0"]


@pytest.mark.gpu
def test_round_trip_on_copy_streams_gpu():
    """Swap-out on d2h, compute overwrites the freed blocks, swap-in on h2d: bit-exact."""
    caches = [c.cuda() for c in device_pool(torch.bfloat16)]
    orch = StreamOrchestrator("cuda", "auto")
    assert orch.asynchronous and orch.h2d is not orch.d2h
    m = OffloadManager(caches, 7, orchestrator=orch)
    blocks = [9, 2, 5]
    saved = [c[blocks].clone() for c in caches]
    m.swap_out("a", blocks)
    orch.begin_compute()
    for c in caches:
        c[blocks] = float("nan")
    m.swap_in("a", [0, 10, 4])
    orch.begin_compute()
    got = [c[[0, 10, 4]].clone() for c in caches]
    pending = orch.tokens_to_host(torch.arange(5, device="cuda") * 2)
    assert pending.result() == [0, 2, 4, 6, 8]
    orch.synchronize()
    for g, s in zip(got, saved):
        assert torch.equal(g, s)
    m.check_invariants()
