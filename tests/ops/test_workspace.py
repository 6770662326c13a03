"""ops/workspace.py: the per-thread scratch buffer grows and is reused, reserve() writes it,
release() frees every thread's; and every kernel that takes scratch from it writes before it
reads: on a buffer of 0xFF bytes (NaN in fp32 and bf16) before each call the ops give the bits
they give on fresh memory, and still match their references and the separate calls."""
from __future__ import annotations

import threading

import pytest
import torch

from cb_kernels.ops import workspace
from cb_kernels.ops.fused_hybrid import (gated_delta_net, gated_delta_net_block_unchecked,
                                         mamba2_mixer)
from cb_kernels.ops.linear import PackedLinear
from tests.ops import (test_fused_decoder, test_fused_hybrid, test_gated_attention,
                       test_mamba2_stack, test_qwen3_next_stack)
from tests.ops.test_fused_hybrid import _call, _call_mamba, make_gdn, make_mamba

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


@pytest.fixture
def poisoned(monkeypatch):
    """Every scratch view filled with 0xFF bytes before the kernel gets it."""
    plain = workspace.scratch

    def scratch(nbytes):
        return plain(nbytes).fill_(0xFF)
    monkeypatch.setattr(workspace, "scratch", scratch)
    yield plain
    workspace.release()


def test_grows_only_and_is_reused():
    workspace.release()
    a = workspace.scratch(1000)
    assert a.dtype == torch.uint8 and a.shape == (1000,) and a.data_ptr() % workspace.ALIGN == 0
    held = workspace.held_bytes()
    assert held >= 1000
    b = workspace.scratch(10)                       # smaller: the same buffer
    assert b.data_ptr() == a.data_ptr() and workspace.held_bytes() == held
    c = workspace.scratch(held + 1)                 # larger: a new one
    assert c.numel() == held + 1 and workspace.held_bytes() > held
    big = workspace.held_bytes()
    assert workspace.release() == big and workspace.held_bytes() == 0


def test_parts_are_disjoint_and_aligned():
    sizes = [5, 64, 0, 130, 1]
    parts = workspace.scratch_parts(sizes)
    assert [p.numel() for p in parts] == sizes
    base = workspace.scratch(0).data_ptr()
    starts = [p.storage_offset() for p in parts]
    assert base % workspace.ALIGN == 0 and all(s % workspace.ALIGN == 0 for s in starts)
    for p, q, n in zip(starts, starts[1:], sizes):
        assert q - p >= n
    assert workspace.parts_bytes(sizes) == starts[-1] + workspace.ALIGN
    workspace.release()


def test_reserve_writes_zeros_and_release_frees_every_thread():
    workspace.release()
    workspace.scratch(4096).fill_(0xFF)
    assert workspace.reserve(4096) >= 4096
    assert int(workspace.scratch(4096).max()) == 0
    reserved, done = threading.Event(), threading.Event()

    def other():
        workspace.reserve(1 << 20)
        reserved.set()
        done.wait(30)          # alive (its buffer with it) until the release below
    t = threading.Thread(target=other)
    t.start()
    assert reserved.wait(30)
    both = workspace.held_bytes()
    assert both >= 4096 + (1 << 20)
    assert workspace.release() == both and workspace.held_bytes() == 0
    done.set()
    t.join()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mixers_give_fresh_memorys_bits_on_garbage_at_any_size(dtype, monkeypatch):
    """A large call, then a small one, then the small one again, on 0xFF bytes: each the bits
    of the same call on a freshly allocated buffer."""
    def gdn(case):
        t, rows, kw = make_gdn(case, dtype, seed=3)
        return _call(gated_delta_net, t, rows, kw), t["state"], t["conv_state"]

    def mamba(case):
        t, rows, kw = make_mamba(case, dtype, seed=4)
        return _call_mamba(mamba2_mixer, t, rows, kw), t["state"], t["conv_state"]

    calls = [(gdn, "hd128-decode-batch"), (gdn, "mixed-rows-awkward"),
             (mamba, "ds128-decode-batch"), (mamba, "mixed-rows-groups")]
    fresh = []
    for fn, case in calls:
        workspace.release()
        fresh.append(fn(case))
    plain = workspace.scratch
    monkeypatch.setattr(workspace, "scratch", lambda n: plain(n).fill_(0xFF))
    for (fn, case), want in zip(calls + calls[::-1], fresh + fresh[::-1]):
        got = fn(case)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case
    workspace.release()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_delta_net_block_on_garbage_is_fresh_memorys_bits(dtype, poisoned, monkeypatch):
    t, (slots, cu, has), kw = make_gdn("mixed-rows-awkward", dtype)
    gen = torch.Generator().manual_seed(6)
    n, hidden = t["qkvz"].shape[0], 48
    lin = [PackedLinear((torch.randn(o, i, generator=gen) * 0.2).to(dtype))
           for o, i in ((t["qkvz"].shape[1], hidden), (t["ba"].shape[1], hidden),
                        (hidden, kw["num_v_heads"] * kw["v_dim"]))]
    w_in, w_post = [(0.1 * torch.randn(hidden, generator=gen)).to(dtype) for _ in range(2)]
    x = torch.randn(n, hidden, generator=gen).to(dtype)

    def run():
        s = {k: v.clone() for k, v in t.items()}
        y = x.clone()
        h = gated_delta_net_block_unchecked(
            y, None, w_in, 1e-6, w_post, 1e-6, *lin, s["conv_weight"], s["conv_bias"],
            s["conv_state"], s["state"], s["dt_bias"], s["neg_a"], s["norm_weight"], slots, cu,
            has, kw["num_k_heads"], kw["num_v_heads"], kw["k_dim"], kw["v_dim"], kw["scale"],
            kw["norm_eps"])
        return y, h, s["state"], s["conv_state"]
    garbage = run()
    workspace.release()
    monkeypatch.setattr(workspace, "scratch", poisoned)     # the plain one: fresh memory
    fresh = run()
    assert all(torch.equal(a, b) for a, b in zip(garbage, fresh))


# The ops' own tests, every scratch call on 0xFF bytes: each compares with its reference or
# with the separate calls, so a read of scratch the kernel never wrote fails there.
@pytest.mark.parametrize("isa", ["auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_hybrid_tests_pass_on_garbage(dtype, isa, poisoned):
    for case in test_fused_hybrid.GDN_CASES:
        test_fused_hybrid.test_gated_delta_net_matches_reference(case, dtype, isa)
    for case in test_fused_hybrid.MAMBA_CASES:
        test_fused_hybrid.test_mamba2_mixer_matches_reference(case, dtype, isa)
    test_fused_hybrid.test_mamba2_block_is_the_separate_calls_bit_for_bit(dtype, dtype, isa)
    test_fused_hybrid.test_mamba2_block_is_the_separate_calls_bit_for_bit(torch.float32, dtype,
                                                                          isa)
    for pending in (True, False):
        test_fused_hybrid.test_gated_delta_net_block_is_the_separate_calls_bit_for_bit(
            dtype, isa, pending)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_attention_tests_pass_on_garbage(dtype, poisoned):
    for case in test_gated_attention.CASES:
        test_gated_attention.test_matches_reference(case, dtype)
        test_gated_attention.test_block_is_the_separate_calls_bit_for_bit(case, dtype, "auto")
    test_gated_attention.test_first_layer_without_pending(dtype)


def test_fused_decoder_tests_pass_on_garbage(poisoned):
    for case in test_fused_decoder.CASES:
        test_fused_decoder.test_matches_reference(case)


def test_mamba2_stack_tests_pass_on_garbage(poisoned):
    for dtypes in test_mamba2_stack.DTYPES:
        test_mamba2_stack.test_stack_is_the_separate_calls_bit_for_bit("mixed-rows-groups",
                                                                       dtypes, "auto")
    test_mamba2_stack.test_stack_steps_reuse_its_workspace_and_continue_the_states()


def test_qwen3_next_stack_tests_pass_on_garbage(poisoned):
    for model in test_qwen3_next_stack.MODELS:
        test_qwen3_next_stack.test_stack_is_the_separate_calls_bit_for_bit(model, "mixed-rows",
                                                                          "auto")
    test_qwen3_next_stack.test_steps_in_a_row_reuse_the_workspace_and_match()


def test_grown_inside_inference_mode_reserve_writes_it_outside():
    """A step (inference_mode) grows the buffer; Engine construction or wake_up (outside it)
    reserves it again."""
    workspace.release()
    with torch.inference_mode():
        workspace.scratch(1 << 16).fill_(7)
    assert workspace.reserve(1 << 16) >= 1 << 16
    assert int(workspace.scratch(1 << 16).max()) == 0
    workspace.release()
