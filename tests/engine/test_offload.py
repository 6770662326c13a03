"""The engine under memory pressure: swap vs recompute give the same greedy tokens, swaps really
happen, nothing leaks, failures stay local, and the host pool sizes itself without psutil."""
import sys

import pytest
import torch

from cb_kernels.engine import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, make_model

BLOCK_SIZE = 4
pytestmark = pytest.mark.one_thread


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def block_bytes(model):
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * BLOCK_SIZE * c.num_key_value_heads * head_dim * 4


PROMPTS = [[(i * 37 + j * 11) % 250 + 1 for j in range(6 + 5 * i)] for i in range(8)]
PARAMS = SamplingParams(max_new_tokens=20)


def make_engine(model, num_blocks=26, host_blocks=0, preemption="auto", **kw):
    gib = host_blocks * block_bytes(model) / (1 << 30)
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=64,
                       max_num_seqs=8, cpu_offload_gib=gib, preemption=preemption,
                       attention_backend=ATTN_BACKEND, **kw)
    return Engine(model, cfg)


def run_checked(engine, prompts=PROMPTS, params=PARAMS):
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_invariants()
    st = engine.stats()
    assert st["used_blocks"] == 0 and st["host_used_blocks"] == 0
    return [outs[i] for i in ids], st


@pytest.fixture(scope="module")
def reference(model):
    outs, st = run_checked(make_engine(model, num_blocks=200, preemption="recompute"))
    assert st["preemptions"] == 0
    return [o.token_ids for o in outs]


def test_reference_matches_generate(model, reference):
    for p, toks in zip(PROMPTS[:2], reference):
        want = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                              min_new_tokens=20)[0, len(p):].tolist()
        assert toks == want


@pytest.mark.parametrize("name, host_blocks, preemption, expect", [
    ("forced-swap", 200, "swap", "swap"),
    ("auto-swap", 200, "auto", "swap"),
    ("forced-recompute", 200, "recompute", "recompute"),
    ("host-exhausted", 8, "swap", "both"),
    ("no-host-pool", 0, "auto", "recompute"),
])
def test_same_tokens_under_pressure(model, reference, name, host_blocks, preemption, expect):
    outs, st = run_checked(make_engine(model, host_blocks=host_blocks, preemption=preemption))
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert st["preemptions"] > 0
    if expect in ("swap", "both"):
        assert st["swaps_out"] > 0 and st["swaps_in"] == st["swaps_out"]
        assert st["swap_bytes"] == (st["swap_blocks_out"] + st["swap_blocks_in"]) * block_bytes(model)
    if expect == "swap":
        assert st["recomputes"] == 0
    if expect in ("recompute", "both"):
        assert st["recomputes"] > 0
    if expect == "recompute":
        assert st["swaps_out"] == 0


def test_swap_without_a_host_pool_is_refused(model):
    with pytest.raises(ValueError, match="preemption='swap' needs a host pool, but cpu_offload_gib=0"):
        EngineConfig(cpu_offload_gib=0, preemption="swap")
    # A pool too small for one block: refused for "swap", reported as recompute for "auto".
    with pytest.raises(ValueError, match="preemption='swap' needs a host pool.*holds no KV block"):
        make_engine(model, host_blocks=0.5, preemption="swap")
    engine = make_engine(model, host_blocks=0.5)
    assert engine.swapper is None and engine.resolved.preemption == "recompute"
    assert engine.resolved.cpu_offload_gib == 0


def test_injected_transfer_failure_leaks_nothing(model, reference):
    engine = make_engine(model, host_blocks=200, preemption="swap")
    offload = engine.swapper.offload
    real = offload._swap_fn
    calls = []

    def flaky(src, dst, mapping, stream=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected DMA error")
        real(src, dst, mapping, stream=stream)
    offload._swap_fn = flaky
    outs, st = run_checked(engine)
    failed = [o for o in outs if o.finish_reason == "error"]
    assert len(failed) == 1 and "injected DMA error" in failed[0].error
    assert st["swap_failures"] == 1 and st["host_used_blocks"] == 0 and st["used_blocks"] == 0
    for o, want in zip(outs, reference):
        if o.finish_reason != "error":
            assert o.token_ids == want


def test_cancel_while_swapped_returns_host_blocks(model):
    engine = make_engine(model, host_blocks=200, preemption="swap")
    for p in PROMPTS:
        engine.add_request(p, PARAMS)
    while not engine.scheduler.swapped:
        engine.step()
        engine.check_invariants()
    seq = engine.scheduler.swapped[0]
    assert engine.stats()["host_used_blocks"] > 0
    engine.cancel(seq.request_id)
    engine.check_invariants()
    assert not engine.swapper.offload.holds(seq.seq_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["host_used_blocks"] == 0 and engine.stats()["used_blocks"] == 0


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """A cgroup v2 dir whose limit leaves 1 MiB of headroom; the reader is pointed at it."""
    from cb_kernels.engine import memory
    (tmp_path / "memory.max").write_text(str(64 << 20))
    (tmp_path / "memory.current").write_text(str(63 << 20))
    monkeypatch.setenv("CBK_CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(memory, "_own_cgroup_v2_dir", lambda root, proc: None)
    return tmp_path


def test_auto_host_pool_obeys_cgroup(model, fake_cgroup):
    engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=2048, max_batch_tokens=64,
                                        max_num_seqs=8, attention_backend=ATTN_BACKEND))
    # Half of the 1 MiB headroom, below the 4 MiB device pool.
    assert engine.stats()["host_total_blocks"] == (512 << 10) // block_bytes(model)


def test_auto_host_pool_without_psutil(model, monkeypatch, reference):
    monkeypatch.setitem(sys.modules, "psutil", None)
    engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=26, max_batch_tokens=64,
                                        max_num_seqs=8, cpu_offload_gib=None, preemption="swap",
                                        attention_backend=ATTN_BACKEND))
    # Auto sizing caps the host pool at the device pool: 26 blocks.
    assert engine.stats()["host_total_blocks"] == 26
    outs, st = run_checked(engine)
    assert [o.token_ids for o in outs] == reference and st["swaps_out"] > 0


def test_recompute_mode_allocates_no_host_pool(model):
    engine = make_engine(model, host_blocks=100, preemption="recompute")
    assert engine.swapper is None and engine.stats()["host_total_blocks"] == 0


def test_swap_with_shared_prefix(model):
    """Requests share a system prompt through the prefix cache; swapped ones copy their shared
    blocks too and come back with the same tokens as without pressure."""
    system = [(j * 29) % 250 + 1 for j in range(12)]
    prompts = [system + [(i * 41 + j) % 250 + 1 for j in range(3 + 4 * i)] for i in range(8)]
    ref, _ = run_checked(make_engine(model, num_blocks=200, preemption="recompute"), prompts)
    outs, st = run_checked(make_engine(model, num_blocks=24, host_blocks=200, preemption="swap"),
                           prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert st["swaps_out"] > 0 and st["prefix_hit_blocks"] > 0
