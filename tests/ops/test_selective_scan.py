"""selective_scan (csrc/cpu/selective_scan.cpp, triton/selective_scan.py) against
ops/reference.py's ref_selective_scan and transformers' mamba2_selective_state_update (Mamba-2's
one-token update, applied token by token), over an explicit case list: grouped heads, awkward
head_dim / d_state, decodes, fresh prefills and continued chunks in one call, empty rows, slots
out of order; both CPU bodies forced; the Triton body under TRITON_INTERPRET=1 on CPU
(tests/conftest.py) and its `gpu` twins on CUDA."""
from __future__ import annotations

import importlib

import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops import _backend
from cb_kernels.ops.reference import ref_selective_scan
from stateful_ops import BODIES, compile_sm90, varlen_batch
from tests.helpers import assert_same_at_threads

# id: (num_heads, head_dim, num_groups, d_state, [(row length, continues from its slot)])
CASES = {
    "decode-one-row": (2, 8, 1, 16, [(1, True)]),
    "prefill-awkward": (3, 13, 1, 17, [(9, False)]),
    "mixed-rows": (4, 16, 2, 32, [(1, True), (7, False), (0, True), (1, True), (4, True)]),
    "d-state-128": (4, 32, 1, 128, [(1, True)] * 3 + [(6, False)]),
    "no-tokens": (2, 8, 1, 16, [(0, True), (0, False)]),      # the fresh row's slot zeroed
}
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def make(case, dtype, seed=0, device="cpu"):
    h, p, grp, n_state, rows = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    n = sum(r for r, _ in rows)
    xbc = torch.randn(n, h * p + 2 * grp * n_state + 5, generator=gen).to(dtype)  # one fused row
    xbc = xbc.to(device)                         # (views made after the move keep the strides)
    x = xbc[:, :h * p].view(n, h, p)
    B = xbc[:, h * p:h * p + grp * n_state].view(n, grp, n_state)
    C = xbc[:, h * p + grp * n_state:h * p + 2 * grp * n_state].view(n, grp, n_state)
    dt = torch.randn(n, h, generator=gen)
    A = -torch.rand(h, generator=gen) * 4.0
    D = torch.randn(h, generator=gen)
    dt_bias = torch.randn(h, generator=gen) * 0.5
    state = torch.randn(len(rows) + 2, h, p, n_state, generator=gen) * 0.5
    slots, cu, has = varlen_batch(rows, len(rows) + 2, gen)
    rest = [t.to(device) for t in (dt, A, state, slots, cu, has, D, dt_bias)]
    dt, A, state, slots, cu, has, D, dt_bias = rest
    return (x, dt, A, B, C, state, slots, cu, has), dict(D=D, dt_bias=dt_bias)


@pytest.mark.parametrize("isa", BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_matches_reference(case, dtype, isa):
    args, kw = make(case, dtype)
    want_state = args[5].clone()
    want = ref_selective_scan(*args[:5], want_state, *args[6:], **kw)
    got = ops.selective_scan(*args, **kw, isa=isa)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(args[5], want_state, **TOL[torch.float32])


def test_dt_limit_and_no_softplus():
    args, kw = make("mixed-rows", torch.float32)
    want_state = args[5].clone()
    want = ref_selective_scan(*args[:5], want_state, *args[6:], dt_softplus=False,
                              dt_limit=(0.1, 0.9), **kw)
    got = ops.selective_scan(*args, dt_softplus=False, dt_limit=(0.1, 0.9), **kw)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(args[5], want_state, **TOL[torch.float32])


def test_matches_transformers_state_update():
    """transformers' mamba2_selective_state_update, one token at a time, on one row."""
    from transformers.models.mamba2 import modeling_mamba2 as m

    args, kw = make("d-state-128", torch.float32)
    x, dt, A, B, C = args[:5]
    state = torch.randn(1, *args[5].shape[1:])
    want_state = state.clone()
    h, p, n = args[5].shape[1:]
    # expanded the way Mamba2Mixer calls it
    want = [m.mamba2_selective_state_update(
        want_state, x[t:t + 1], dt[t:t + 1, :, None].expand(-1, -1, p),
        A[:, None, None].expand(-1, p, n), B[t:t + 1], C[t:t + 1],
        kw["D"][:, None].expand(-1, p), dt_bias=kw["dt_bias"][:, None].expand(-1, p),
        dt_softplus=True) for t in range(x.shape[0])]
    got = ops.selective_scan(x, dt, A, B, C, state, torch.tensor([0]),
                             torch.tensor([0, x.shape[0]], dtype=torch.int32),
                             torch.tensor([True]), **kw)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


def test_batch_invariance_and_registered_op():
    args, kw = make("mixed-rows", torch.float32)
    x, dt, A, B, C, state, slots, cu, has = args
    together = state.clone()
    out = torch.ops.cb_kernels.selective_scan(x, dt, A, B, C, together, slots, cu, has,
                                              kw["D"], kw["dt_bias"])
    for i in range(slots.shape[0]):
        a, e = int(cu[i]), int(cu[i + 1])
        alone = state.clone()
        got = ops.selective_scan(x[a:e], dt[a:e], A, B[a:e], C[a:e], alone, slots[i:i + 1],
                                 torch.tensor([0, e - a], dtype=torch.int32), has[i:i + 1], **kw)
        assert torch.equal(got, out[a:e]) and torch.equal(alone[slots[i]], together[slots[i]])
    torch.library.opcheck(torch.ops.cb_kernels.selective_scan.default,
                          (x, dt, A, B, C, state.clone(), slots, cu, has, kw["D"], kw["dt_bias"]))


def _bad(**change):
    args, kw = make("mixed-rows", torch.float32)
    named = dict(zip(("x", "dt", "A", "B", "C", "state", "slots", "cu_seqlens", "has_state"),
                     args), **kw)
    named.update(change)
    return lambda: ops.selective_scan(**named)


@pytest.mark.parametrize("call, error, match", [
    (_bad(x=torch.zeros(13, 4, 16, dtype=torch.float16)), TypeError, "x must be float32 or bfloat16"),
    (_bad(x=torch.zeros(13, 16, 4).transpose(1, 2)), ValueError, "x's heads and head_dim must be packed"),
    (_bad(B=torch.zeros(13, 3, 32), C=torch.zeros(13, 3, 32)), ValueError, "a multiple of num_groups"),
    (_bad(dt=torch.zeros(13, 4, dtype=torch.bfloat16)), TypeError, "dt must have dtype torch.float32"),
    (_bad(D=torch.zeros(5)), ValueError, r"D must have shape \[4\]"),
    (_bad(state=torch.zeros(7, 4, 16, 31)), ValueError, "state must have shape"),
    (_bad(slots=torch.tensor([0, 1, 2, 3, 3])), ValueError, "slots must be distinct"),
    (_bad(dt_bias=torch.zeros(4, device="meta")), ValueError, "dt_bias is on meta but x is on cpu"),
], ids=["fp16", "x-strides", "groups", "dt-dtype", "D-shape", "state-shape", "slot-twice",
        "dt-bias-device"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("lengths", [[1, 48, 1, 1, 9], [1] * 20 + [48] + [1] * 20 + [9]],
                         ids=["few_rows", "many_rows_chunked"])
def test_thread_split_does_not_change_bits(lengths):
    """A call big enough for two threads (a long prefill row among decodes, split longest first
    over (row, head) items) gives the bits of the one-thread call, state included; with many
    rows the threads take the items in chunks of several (varlen_items.h), across rows."""
    gen = torch.Generator().manual_seed(6)
    h, p, n_state = 4, 32, 64
    n = sum(lengths)
    x = torch.randn(n, h, p, generator=gen)
    B, C = torch.randn(2, n, 1, n_state, generator=gen)
    dt = torch.randn(n, h, generator=gen)
    A = -torch.rand(h, generator=gen)
    state = torch.randn(len(lengths), h, p, n_state, generator=gen)
    slots = torch.arange(len(lengths))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    has = torch.tensor([i % 3 != 1 for i in range(len(lengths))])
    assert_same_at_threads(lambda s: ops.selective_scan(x, dt, A, B, C, s, slots, cu, has), state)


# The Triton body: id -> (CASES id, keyword arguments over make's). The interpreter runs each in
# well under a second (2 cores, Zen 4).
TRITON_CASES = {
    **{case: (case, {}) for case in CASES},
    "no-softplus-clamp-no-D": ("mixed-rows", dict(dt_softplus=False, dt_limit=(0.1, 0.9),
                                                  D=None, dt_bias=None)),
    "clamp-below-only": ("prefill-awkward", dict(dt_limit=(0.5, float("inf")))),
}
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: under TRITON_INTERPRET=1


def check_triton(case, dtype, device, backend):
    """The op on `device` against the reference: outputs within TOL, the touched slots' state
    within fp32's, every other slot bit for bit as it was."""
    base, extra = TRITON_CASES[case]
    args, kw = make(base, dtype, device=device)
    kw.update(extra)
    before = args[5].clone()
    want_state = args[5].clone()
    want = ref_selective_scan(*args[:5], want_state, *args[6:], **kw)
    got = ops.selective_scan(*args, **kw, backend=backend)
    assert got.dtype == dtype and got.device == args[0].device
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(args[5], want_state, **TOL[torch.float32])
    untouched = [s for s in range(before.shape[0]) if s not in args[6].tolist()]
    assert untouched and torch.equal(args[5][untouched], before[untouched])


def check_triton_batch_invariance(dtype, device):
    """Each row run alone gives the bits it gets in the whole batch, its slot's state too."""
    args, kw = make("mixed-rows", dtype, device=device)
    x, dt, A, B, C, state, slots, cu, has = args
    together = state.clone()
    out = ops.selective_scan(x, dt, A, B, C, together, slots, cu, has, **kw, backend="triton")
    for i in range(slots.shape[0]):
        a, e = int(cu[i]), int(cu[i + 1])
        alone = state.clone()
        got = ops.selective_scan(x[a:e], dt[a:e], A, B[a:e], C[a:e], alone, slots[i:i + 1],
                                 torch.tensor([0, e - a], dtype=torch.int32, device=device),
                                 has[i:i + 1], **kw, backend="triton")
        assert torch.equal(got, out[a:e]) and torch.equal(alone[slots[i]], together[slots[i]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_matches_reference(case, dtype):
    """Under TRITON_INTERPRET=1 on CPU (tests/conftest.py), on the GPU where there is one."""
    check_triton(case, dtype, _DEVICE, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_rows_do_not_depend_on_the_batch(dtype):
    check_triton_batch_invariance(dtype, _DEVICE)


def check_small_steps(device, backend):
    """dt' = softplus(dt) for dt down to -16 (steps of 1e-7 .. 0.3) to fp32's relative precision:
    with x, B, C all ones, a fresh state and no D, out = d_state * dt' (a plain
    log(1 + exp(dt)) in the Triton body measured 17% off at dt = -15, 1e-3 at -10)."""
    dt = torch.linspace(-16.0, -1.0, 16, device=device)[:, None]            # 16 one-token rows
    n, d_state = dt.shape[0], 8
    ones = torch.ones(n, 1, d_state, device=device)
    state = torch.zeros(n, 1, 1, d_state, device=device)
    got = ops.selective_scan(torch.ones(n, 1, 1, device=device), dt,
                             torch.zeros(1, device=device), ones, ones,
                             state, torch.arange(n, device=device),
                             torch.arange(n + 1, dtype=torch.int32, device=device),
                             torch.zeros(n, dtype=torch.bool, device=device), backend=backend)
    want = torch.nn.functional.softplus(dt.double()) * d_state
    torch.testing.assert_close(got[:, 0, 0].double(), want[:, 0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_small_steps_keep_their_precision(backend):
    check_small_steps(_DEVICE if backend == "triton" else "cpu", backend)


def test_cuda_default_is_triton(monkeypatch):
    """On CUDA tensors backend=None takes triton, also where the compiled CUDA kernels run (this
    op has none: "cuda" there would hand device pointers to the CPU body)."""
    monkeypatch.setattr(_backend, "cuda_kernels_error", lambda: "")
    monkeypatch.setattr(_backend, "triton_error", lambda: "")
    ours = [importlib.import_module(f"cb_kernels.ops.{name}")._BACKENDS
            for name in ("selective_scan", "causal_conv1d", "gated_delta_rule")]
    assert [_backend.default_cuda_backend(b) for b in ours] == ["triton"] * 3
    assert _backend.default_cuda_backend(("cuda", "triton", "cpu", "torch")) == "cuda"
    monkeypatch.setattr(_backend, "triton_error", lambda: "triton is not importable")
    assert _backend.default_cuda_backend(ours[0]) == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_gpu_triton_matches_reference(case, dtype):
    """The GPU stage: every Triton case on CUDA tensors, backend=None (triton there)."""
    check_triton(case, dtype, "cuda", None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_triton_rows_do_not_depend_on_the_batch(dtype):
    check_triton_batch_invariance(dtype, "cuda")


@pytest.mark.gpu
def test_gpu_small_steps_keep_their_precision():
    check_small_steps("cuda", None)


# The kernel compiled for sm_90 in a fresh process without TRITON_INTERPRET (triton's bundled
# ptxas; no GPU needed): what the interpreter never checks (types, constexpr branches) fails
# here before a GPU minute is spent, and cuobjdump's LOCAL (spilled bytes) must be 0.
_COMPILE_SM90 = """
from cb_kernels.triton.selective_scan import _selective_scan_kernel, tile_sizes

block_p, block_n = tile_sizes(64, 128)                   # Mamba-2: head_dim 64, d_state 128
for act in ("fp32", "bf16"):
    for flags in ((True, True, True, False), (False, False, False, True)):
        const = dict(NUM_HEADS=80, HEAD_DIM=64, GROUP=80, D_STATE=128, BLOCK_P=block_p,
                     BLOCK_N=block_n, HAS_D=flags[0], HAS_DT_BIAS=flags[1], SOFTPLUS=flags[2],
                     CLAMP=flags[3])
        sig = dict(p_x="*" + act, p_dt="*fp32", p_A="*fp32", p_B="*" + act, p_C="*" + act,
                   p_D="*fp32", p_dt_bias="*fp32", p_state="*fp32", p_out="*" + act,
                   p_slots="*i64", p_cu_seqlens="*i32", p_has_state="*u8", s_x_t="i32",
                   s_b_t="i32", s_c_t="i32", dt_lo="fp32", dt_hi="fp32",
                   **{k: "constexpr" for k in const})
        print(act, flags, sm90(_selective_scan_kernel, sig, const)[1])
"""


def test_triton_kernel_compiles_for_sm90_without_spills(tmp_path):
    lines = compile_sm90(_COMPILE_SM90, tmp_path)
    assert len(lines) == 4 and all("'LOCAL:0'" in line for line in lines), lines
