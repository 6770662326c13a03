"""causal_conv1d (csrc/cpu/causal_conv1d.cpp, triton/causal_conv1d.py) against
ops/reference.py's ref_causal_conv1d and transformers' causal_conv1d_fn / causal_conv1d_update
(the Qwen3-Next layer's prefill and decode), over an explicit case list: channel counts off the
64-channel block, rows shorter than the window, decodes and continued chunks mixed with fresh
prefills, empty rows, slots out of order; both CPU bodies forced; the thread split never changes
a bit; the Triton body under TRITON_INTERPRET=1 on CPU (tests/conftest.py) and its `gpu` twins
on CUDA."""
from __future__ import annotations

import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_causal_conv1d
from stateful_ops import BODIES, compile_sm90, varlen_batch
from tests.helpers import assert_same_at_threads

# id: (channels, width, state_len, bias, [(row length, continues from its slot)])
CASES = {
    "decode-one-row": (8, 4, 4, False, [(1, True)]),
    "prefill-short-row": (70, 4, 4, True, [(2, False)]),
    "mixed-rows": (130, 4, 4, False, [(1, True), (9, False), (1, True), (0, True), (3, True),
                                      (0, False), (5, False)]),
    "width-2-long-state": (64, 2, 5, True, [(3, True), (1, True), (6, False)]),
    "decodes-width-4-state-3": (100, 4, 3, True, [(1, True), (1, True), (2, True)]),
    "no-tokens": (70, 4, 4, False, [(0, True), (0, False)]),   # the fresh row's window zeroed
}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def make(case, dtype, seed=0, device="cpu"):
    channels, width, state_len, bias, rows = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    n = sum(length for length, _ in rows)
    x = torch.randn(n, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    num_slots = len(rows) + 1
    state = torch.randn(num_slots, channels, state_len, generator=gen).to(dtype)
    slots, cu, has_state = varlen_batch(rows, num_slots, gen)
    return tuple(None if t is None else t.to(device)
                 for t in (x, weight, b, state, slots, cu, has_state))


@pytest.mark.parametrize("isa", BODIES)
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_matches_reference(case, dtype, activation, isa):
    x, w, b, state, slots, cu, has = make(case, dtype)
    want_state = state.clone()
    want = ref_causal_conv1d(x, w, b, want_state, slots, cu, has, activation=activation)
    got = ops.causal_conv1d(x, w, b, state, slots, cu, has, activation=activation, isa=isa)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(state, want_state)        # the window is a copy of inputs: same bits


@pytest.mark.parametrize("isa", BODIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width, state_len", [(4, 4), (4, 3), (3, 6)])
def test_decode_path_same_bits_as_chunk(width, state_len, dtype, isa):
    """One-token continuing rows take their own path (no transposed copies); two of them in a
    row give the bits of the same two tokens as one continued chunk (the general path)."""
    gen = torch.Generator().manual_seed(3)
    channels = 150
    x = torch.randn(2, channels, generator=gen).to(dtype)
    w = torch.randn(channels, width, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype)
    state = torch.randn(2, channels, state_len, generator=gen).to(dtype)
    slot = torch.tensor([1])
    has = torch.tensor([True])
    chunk_state = state.clone()
    chunk = ops.causal_conv1d(x, w, b, chunk_state, slot, torch.tensor([0, 2], dtype=torch.int32),
                              has, isa=isa)
    one = torch.tensor([0, 1], dtype=torch.int32)
    steps = torch.cat([ops.causal_conv1d(x[t:t + 1], w, b, state, slot, one, has, isa=isa)
                       for t in range(2)])
    assert torch.equal(steps, chunk)
    assert torch.equal(state, chunk_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_transformers_functions(dtype):
    """A prefill through transformers' update_conv_state + causal_conv1d_fn, then two decodes
    through causal_conv1d_update, against the op on one slot."""
    from transformers.cache_utils import LinearAttentionLayer
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    gen = torch.Generator().manual_seed(2)
    channels, width, length = 48, 4, 6
    x = torch.randn(1, channels, length + 2, generator=gen).to(dtype)
    w = torch.randn(channels, width, generator=gen).to(dtype)
    layer = LinearAttentionLayer()
    full = layer.update_conv_state(x[:, :, :length], 0, conv_kernel_size=width)
    want = [m.causal_conv1d_fn(full, w, None, activation="silu")[:, :, -length:]]
    for t in (length, length + 1):
        want.append(m.causal_conv1d_update(x[:, :, t:t + 1], layer.conv_states[0], w, None,
                                           "silu"))
    want = torch.cat(want, dim=-1)[0].t()

    state = torch.zeros(2, channels, width, dtype=dtype)
    slot = torch.tensor([1])
    xt = x[0].t().contiguous()
    got = [ops.causal_conv1d(xt[:length], w, None, state, slot,
                             torch.tensor([0, length], dtype=torch.int32), torch.tensor([False]))]
    for t in (length, length + 1):
        got.append(ops.causal_conv1d(xt[t:t + 1], w, None, state, slot,
                                     torch.tensor([0, 1], dtype=torch.int32),
                                     torch.tensor([True])))
    torch.testing.assert_close(torch.cat(got), want, **TOL[dtype])
    assert torch.equal(state[1], layer.conv_states[0][0])


def test_strided_tokens_and_batch_invariance():
    x, w, b, state, slots, cu, has = make("mixed-rows", torch.float32)
    wide = torch.cat([x, torch.randn(x.shape[0], 7)], dim=1)[:, :x.shape[1]]   # tokens 137 apart
    together = state.clone()
    out = ops.causal_conv1d(wide, w, b, together, slots, cu, has)
    for i in range(slots.shape[0]):
        a, e = int(cu[i]), int(cu[i + 1])
        alone = state.clone()
        got = ops.causal_conv1d(x[a:e], w, b, alone, slots[i:i + 1],
                                torch.tensor([0, e - a], dtype=torch.int32), has[i:i + 1])
        assert torch.equal(got, out[a:e]) and torch.equal(alone[slots[i]], together[slots[i]])


def test_registered_op():
    x, w, b, state, slots, cu, has = make("mixed-rows", torch.float32)
    s2 = state.clone()
    got = torch.ops.cb_kernels.causal_conv1d(x, w, b, state, slots, cu, has, True)
    want = ref_causal_conv1d(x, w, b, s2, slots, cu, has)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(state, s2)
    torch.library.opcheck(torch.ops.cb_kernels.causal_conv1d.default,
                          (x, w, b, state, slots, cu, has, True))


def _bad(**change):
    args = dict(zip(("x", "weight", "bias", "conv_state", "slots", "cu_seqlens", "has_state"),
                    make("mixed-rows", torch.float32)))
    args.update(change)
    return lambda: ops.causal_conv1d(**args)


@pytest.mark.parametrize("call, error, match", [
    (_bad(x=torch.zeros(19, 130, dtype=torch.float16)), TypeError, "x must be float32 or bfloat16"),
    (_bad(weight=torch.zeros(130, 17)), ValueError, "1 <= width <= 16"),
    (_bad(weight=torch.zeros(130, 4, dtype=torch.bfloat16)), TypeError, "weight must have dtype"),
    (_bad(conv_state=torch.zeros(8, 130, 2)), ValueError, "state_len >= 3"),
    (_bad(bias=torch.zeros(3)), ValueError, r"bias must have shape \[130\]"),
    (_bad(slots=torch.tensor([0, 1, 2, 3, 4, 5, 8])), ValueError, r"slots must lie in \[0, 8\)"),
    (_bad(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)), ValueError,
     "cu_seqlens must start at 0, end at num_tokens=19"),
    (lambda: ops.causal_conv1d(*make("mixed-rows", torch.float32), activation="gelu"),
     ValueError, "activation must be None or 'silu'"),
], ids=["fp16", "width", "weight-dtype", "state-len", "bias-shape", "slot-range", "cu-end",
        "activation"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("lengths", [[1, 300, 1, 1, 40, 1], [1] * 20 + [300] + [1] * 20],
                         ids=["few_rows", "many_rows_chunked"])
def test_thread_split_does_not_change_bits(lengths):
    """A call big enough for two threads (one long prefill row, decodes around it: the rows are
    split longest first) gives the bits of the one-thread call, state included; with many rows
    the threads take the items in chunks of several (varlen_items.h), across rows."""
    gen = torch.Generator().manual_seed(5)
    channels, width = 256, 4
    n = sum(lengths)
    x = torch.randn(n, channels, generator=gen)
    w = torch.randn(channels, width, generator=gen)
    state = torch.randn(len(lengths), channels, width, generator=gen)
    slots = torch.arange(len(lengths))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    has = torch.tensor([n != 300 for n in lengths])
    assert_same_at_threads(lambda s: ops.causal_conv1d(x, w, None, s, slots, cu, has), state)


_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # CPU: under TRITON_INTERPRET=1


def check_triton(case, dtype, activation, device, backend):
    """The op on `device` against the reference: outputs within TOL; every slot (the windows are
    copies of inputs, the untouched slot as it was) bit for bit."""
    x, w, b, state, slots, cu, has = make(case, dtype, device=device)
    before = state.clone()
    want_state = state.clone()
    want = ref_causal_conv1d(x, w, b, want_state, slots, cu, has, activation=activation)
    got = ops.causal_conv1d(x, w, b, state, slots, cu, has, activation=activation,
                            backend=backend)
    assert got.dtype == dtype and got.device == x.device
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(state, want_state)
    untouched = [s for s in range(state.shape[0]) if s not in slots.tolist()]
    assert untouched and torch.equal(state[untouched], before[untouched])


def check_triton_decodes_and_batch(dtype, device, backend):
    """Two one-token steps give the bits of the same two tokens as one chunk; each row run alone
    (x's tokens strided) gives the bits it gets in the whole batch, its window too."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 150, generator=gen).to(dtype).to(device)
    w = torch.randn(150, 4, generator=gen).to(dtype).to(device)
    state = torch.randn(2, 150, 3, generator=gen).to(dtype).to(device)
    slot, has = torch.tensor([1], device=device), torch.tensor([True], device=device)
    chunk_state = state.clone()
    chunk = ops.causal_conv1d(x, w, None, chunk_state, slot,
                              torch.tensor([0, 2], dtype=torch.int32, device=device), has,
                              backend=backend)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    steps = torch.cat([ops.causal_conv1d(x[t:t + 1], w, None, state, slot, one, has,
                                         backend=backend) for t in range(2)])
    assert torch.equal(steps, chunk) and torch.equal(state, chunk_state)

    x, w, b, state, slots, cu, has = make("mixed-rows", dtype, device=device)
    wide = torch.cat([x, x[:, :7]], dim=1)[:, :x.shape[1]]           # tokens 137 apart
    together = state.clone()
    out = ops.causal_conv1d(wide, w, b, together, slots, cu, has, backend=backend)
    for i in range(slots.shape[0]):
        a, e = int(cu[i]), int(cu[i + 1])
        alone = state.clone()
        got = ops.causal_conv1d(x[a:e], w, b, alone, slots[i:i + 1],
                                torch.tensor([0, e - a], dtype=torch.int32, device=device),
                                has[i:i + 1], backend=backend)
        assert torch.equal(got, out[a:e]) and torch.equal(alone[slots[i]], together[slots[i]])


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case, dtype, activation):
    """Under TRITON_INTERPRET=1 on CPU (tests/conftest.py), on the GPU where there is one."""
    check_triton(case, dtype, activation, _DEVICE, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_decodes_and_batch_invariance(dtype):
    check_triton_decodes_and_batch(dtype, _DEVICE, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_triton_matches_reference(case, dtype, activation):
    """The GPU stage: every case on CUDA tensors, backend=None (triton there)."""
    check_triton(case, dtype, activation, "cuda", None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_triton_decodes_and_batch_invariance(dtype):
    check_triton_decodes_and_batch(dtype, "cuda", None)


# The kernel compiled for sm_90 in a fresh process without TRITON_INTERPRET (triton's bundled
# ptxas; no GPU needed): what the interpreter never checks (types, constexpr branches, the
# barrier) fails here before a GPU minute is spent; the barrier must be in the code and
# cuobjdump's LOCAL (spilled bytes) 0.
_COMPILE_SM90 = """
from cb_kernels.triton.causal_conv1d import _causal_conv1d_kernel, block_channels

for act in ("fp32", "bf16"):
    for channels, bias, silu in ((8192, True, True), (20, False, False)):
        block_c = block_channels(channels)
        const = dict(CHANNELS=channels, WIDTH=4, STATE_LEN=4, BLOCK_C=block_c, BLOCK_L=4,
                     HAS_BIAS=bias, SILU=silu)
        sig = dict(p_x="*" + act, p_weight="*" + act, p_bias="*" + act, p_state="*" + act,
                   p_out="*" + act, p_slots="*i64", p_cu_seqlens="*i32", p_has_state="*u8",
                   s_x_t="i32", **{k: "constexpr" for k in const})
        k, usage = sm90(_causal_conv1d_kernel, sig, const, num_warps=block_c // 32)
        print(act, channels, "bar.sync" in k.asm["ptx"] or "barrier.sync" in k.asm["ptx"], usage)
"""


def test_triton_kernel_compiles_for_sm90_without_spills(tmp_path):
    lines = compile_sm90(_COMPILE_SM90, tmp_path)
    assert len(lines) == 4 and all(" True " in line and "'LOCAL:0'" in line
                                   for line in lines), lines
