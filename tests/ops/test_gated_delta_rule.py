"""gated_delta_rule (csrc/cpu/gated_delta.cpp, triton/gated_delta_rule.py) against
ops/reference.py's ref_gated_delta_rule and against transformers' own torch_chunk_gated_delta_rule
/ torch_recurrent_gated_delta_rule (what generate() runs), over an explicit case list: awkward
dims (column tiles with a remainder), grouped heads, several rows of different lengths, decodes,
fresh prefills and continued prefill chunks in one call, empty rows; every CPU body forced."""
from __future__ import annotations

import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.reference import ref_gated_delta_rule
from tests.helpers import assert_same_at_threads

# id: (num_k_heads, num_v_heads, k_dim, v_dim, [(row length, continues from its slot)])
CASES = {
    "decode-one-row": (1, 1, 16, 16, [(1, True)]),
    "prefill-awkward-dims": (1, 3, 20, 37, [(7, False)]),
    "mixed-rows": (2, 4, 24, 70, [(1, True), (13, False), (1, True), (0, False), (5, True),
                                  (3, False)]),
    "hd128-decode-batch": (2, 4, 128, 128, [(1, True)] * 5 + [(9, False)]),
    "tile-plus-remainder": (1, 2, 33, 131, [(4, True), (1, True)]),
}
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]


def make(case, dtype, seed=0, num_slots=None):
    hk, hv, kd, vd, rows = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    n = sum(length for length, _ in rows)
    q = torch.randn(n, hk, kd, generator=gen).to(dtype)
    k = torch.randn(n, hk, kd, generator=gen).to(dtype)
    v = torch.randn(n, hv, vd, generator=gen).to(dtype)
    g = -torch.rand(n, hv, generator=gen) * 2.0                  # log decay in (-2, 0]
    beta = torch.rand(n, hv, generator=gen)
    num_slots = num_slots or len(rows) + 2
    state = torch.randn(num_slots, hv, kd, vd, generator=gen) * 0.5
    slots = torch.randperm(num_slots, generator=gen)[:len(rows)]
    cu = torch.tensor([0] + [length for length, _ in rows], dtype=torch.int32).cumsum(0)
    has_state = torch.tensor([c for _, c in rows], dtype=torch.bool)
    return q, k, v, g, beta, state, slots, cu.to(torch.int32), has_state


def run_both(case, dtype, **kw):
    args = make(case, dtype)
    want_state = args[5].clone()
    want = ref_gated_delta_rule(*args[:5], want_state, *args[6:])
    got_state = args[5].clone()
    got = ops.gated_delta_rule(*args[:5], got_state, *args[6:], **kw)
    return got, want, got_state, want_state


@pytest.mark.parametrize("isa", _BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_matches_reference(case, dtype, isa):
    got, want, got_state, want_state = run_both(case, dtype, isa=isa)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the state is fp32 in both; with bf16 inputs only the output's rounding differs
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])


def test_auto_body_is_avx512_where_the_cpu_has_it():
    want = "avx512" if "avx512" in _C.cpu_isas() else "portable"
    assert _C.gated_delta_rule_isa("auto") == want
    assert _C.gated_delta_rule_isa("portable") == "portable"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_k_heads, num_v_heads, k_dim, v_dim, length", [
    (1, 2, 16, 24, 1), (2, 4, 32, 40, 1), (1, 2, 16, 24, 70), (2, 2, 128, 128, 37),
], ids=["decode", "decode-gqa", "prefill-two-chunks", "prefill-hd128"])
def test_matches_transformers_functions(num_k_heads, num_v_heads, k_dim, v_dim, length, dtype):
    """One row in transformers' layout [1, T, H, D]: the chunked prefill (from a state, T > 1)
    and the recurrent decode (T == 1) that the Qwen3-Next layer calls."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, length, num_k_heads, k_dim, generator=gen).to(dtype)
    k = torch.randn(1, length, num_k_heads, k_dim, generator=gen).to(dtype)
    v = torch.randn(1, length, num_v_heads, v_dim, generator=gen).to(dtype)
    g = -torch.rand(1, length, num_v_heads, generator=gen) * 2.0
    beta = torch.rand(1, length, num_v_heads, generator=gen)
    init = torch.randn(1, num_v_heads, k_dim, v_dim, generator=gen) * 0.5
    fn = m.torch_recurrent_gated_delta_rule if length == 1 else m.torch_chunk_gated_delta_rule
    # The layer repeats q/k heads to the v heads before it calls these functions (transformers
    # 5.17's recurrent one takes equal head counts only); our op takes the unrepeated heads.
    group = num_v_heads // num_k_heads
    want, want_state = fn(q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2),
                          v, g=g, beta=beta, initial_state=init.clone(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = init.clone()
    got = ops.gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], state,
                               torch.tensor([0]), torch.tensor([0, length], dtype=torch.int32),
                               torch.tensor([True]))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(got, want[0], **tol)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


def test_rows_do_not_depend_on_the_batch_and_other_slots_stay():
    """Each row alone gives the bits it gives inside the mixed call; slots no row names keep
    their bits."""
    q, k, v, g, beta, state, slots, cu, has_state = make("mixed-rows", torch.float32)
    together = state.clone()
    out = ops.gated_delta_rule(q, k, v, g, beta, together, slots, cu, has_state)
    for i in range(slots.shape[0]):
        a, b = int(cu[i]), int(cu[i + 1])
        alone = state.clone()
        got = ops.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], alone,
                                   slots[i:i + 1], torch.tensor([0, b - a], dtype=torch.int32),
                                   has_state[i:i + 1])
        assert torch.equal(got, out[a:b]), i
        assert torch.equal(alone[slots[i]], together[slots[i]]), i
    untouched = [s for s in range(state.shape[0]) if s not in slots.tolist()]
    assert torch.equal(together[untouched], state[untouched])


def test_strided_views_and_out():
    """q, k, v as views into one fused [num_tokens, ...] projection, as the runner passes them."""
    q, k, v, g, beta, state, slots, cu, has_state = make("mixed-rows", torch.float32)
    n, hk, kd = q.shape
    fused = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    qv = fused[:, :hk * kd].view(n, hk, kd)
    kv = fused[:, hk * kd:2 * hk * kd].view(n, hk, kd)
    vv = fused[:, 2 * hk * kd:].view(n, *v.shape[1:])
    want_state = state.clone()
    want = ref_gated_delta_rule(q, k, v, g, beta, want_state, slots, cu, has_state)
    out = torch.empty_like(v)
    got = ops.gated_delta_rule(qv, kv, vv, g, beta, state, slots, cu, has_state, out=out)
    assert got is out
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(state, want_state, **TOL[torch.float32])


def test_registered_op_and_torch_backend():
    args = make("mixed-rows", torch.float32)
    s1, s2 = args[5].clone(), args[5].clone()
    got = torch.ops.cb_kernels.gated_delta_rule(*args[:5], s1, *args[6:], 24 ** -0.5)
    want = ops.gated_delta_rule(*args[:5], s2, *args[6:], backend="torch")
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(s1, s2, **TOL[torch.float32])
    torch.library.opcheck(torch.ops.cb_kernels.gated_delta_rule.default,
                          (*args[:5], args[5].clone(), *args[6:], 24 ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["mixed-rows", "prefill-awkward-dims"])
def test_triton_matches_reference(case, dtype):
    """Under TRITON_INTERPRET=1 on CPU (tests/conftest.py), on the GPU where there is one."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = [t.to(device) for t in make(case, dtype)]
    want_state = args[5].clone()
    want = ref_gated_delta_rule(*args[:5], want_state, *args[6:])
    got = ops.gated_delta_rule(*args, backend="triton")
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(args[5], want_state, **TOL[torch.float32])


def _bad(**change):
    args = dict(zip(("q", "k", "v", "g", "beta", "state", "slots", "cu_seqlens", "has_state"),
                    make("mixed-rows", torch.float32)))
    args.update(change)
    return lambda: ops.gated_delta_rule(**args)


_Q = make("mixed-rows", torch.float32)[0]
_STATE = make("mixed-rows", torch.float32)[5]


@pytest.mark.parametrize("call, error, match", [
    (_bad(q=_Q.half()), TypeError, "q must be float32 or bfloat16"),
    (_bad(k=_Q.bfloat16()), TypeError, "q, k and v must share a dtype"),
    (_bad(q=_Q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q's last dim must be packed"),
    (_bad(v=torch.zeros(23, 3, 70)), ValueError, "num_v_heads .3. must be a multiple"),
    (_bad(g=torch.zeros(23, 4, dtype=torch.float64)), TypeError, "g must have dtype torch.float32"),
    (_bad(state=_STATE[:, :, :, :69].contiguous()), ValueError, "state must have shape"),
    (_bad(slots=torch.tensor([0, 1, 2, 3, 4, 99])), ValueError, r"slots must lie in \[0, 8\)"),
    (_bad(slots=torch.tensor([0, 1, 2, 3, 4, 0])), ValueError, "slots must be distinct"),
    (_bad(cu_seqlens=torch.tensor([0, 1, 14, 15, 15, 20, 22], dtype=torch.int32)), ValueError,
     "cu_seqlens must start at 0, end at num_tokens=23"),
    (_bad(cu_seqlens=torch.tensor([0, 1, 14], dtype=torch.int32)), ValueError,
     "cu_seqlens must have num_seqs . 1 entries"),
    (_bad(has_state=torch.ones(6, dtype=torch.int32)), TypeError, "has_state must have dtype torch.bool"),
    (_bad(q=None), TypeError, "q must be a torch.Tensor"),
], ids=["fp16", "mixed-dtypes", "unpacked-dim", "heads", "g-dtype", "state-shape", "slot-range",
        "slot-twice", "cu-end", "cu-length", "has-state-dtype", "not-a-tensor"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_triton_matches_reference(case, dtype):
    """The GPU stage: every case on CUDA tensors (the default backend there is triton)."""
    args = [t.cuda() for t in make(case, dtype)]
    want_state = args[5].clone()
    want = ref_gated_delta_rule(*args[:5], want_state, *args[6:])
    got = ops.gated_delta_rule(*args)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(args[5], want_state, **TOL[torch.float32])


def test_thread_split_does_not_change_bits():
    """A call big enough for two threads (a long prefill row among decodes: rows split longest
    first over (row, head) items) gives the bits of the one-thread call, state included."""
    gen = torch.Generator().manual_seed(4)
    lengths, hk, hv, kd, vd = [1, 1, 64, 1, 17, 1], 2, 4, 64, 64
    n = sum(lengths)
    q, k = torch.randn(2, n, hk, kd, generator=gen)
    v = torch.randn(n, hv, vd, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(len(lengths), hv, kd, vd, generator=gen) * 0.5
    slots = torch.arange(len(lengths)).flip(0)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    has = torch.tensor([True, True, False, True, False, True])
    assert_same_at_threads(lambda s: ops.gated_delta_rule(q, k, v, g, beta, s, slots, cu, has), state)
