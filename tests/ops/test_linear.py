"""ops.PackedLinear (csrc/cpu/linear.cpp): y = x @ W.T + b on a packed weight. Every body
(AVX-512, AVX2, plain C++) gives the same bits, a row's result does not depend on the other rows
or the thread count, and the values match ops/reference.py's ref_linear (float64) to fp32
rounding; the registered functional op `cb_kernels::linear` over the packed tensors."""
import pytest
import torch

from cb_kernels import _C
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.reference import ref_linear

HERE = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx2", "avx512")]


def _case(m, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("m, k, n, bias", [
    (1, 13, 7, False), (5, 64, 33, True), (37, 256, 384, False), (16, 576, 96, True),
    (130, 100, 70, True),             # two row chunks, a partial panel
    (12, 1, 32, False), (25, 3, 1, True),
])
def test_matches_reference_and_every_body_gives_the_same_bits(m, k, n, bias):
    x, w, b = _case(m, k, n, bias, seed=m + k + n)
    lin = PackedLinear(w, b)
    want = ref_linear(x.double(), w, b)
    outs = {isa: lin(x, isa=isa) for isa in HERE}
    for isa, y in outs.items():
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
        assert torch.equal(y, outs[HERE[0]]), f"{isa} differs from {HERE[0]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_depends_on_nothing_else(threads, dtype):
    """Batch invariance: a row alone, inside batches of any size and at any thread count gives the
    same bits."""
    x, w, b = (t.to(dtype) for t in _case(150, 192, 200, True, seed=1))
    lin = PackedLinear(w, b)
    torch.set_num_threads(threads)      # conftest restores the thread count
    full = lin(x)
    for rows in (slice(7, 8), slice(0, 13), slice(40, 140), slice(149, 150)):
        assert torch.equal(lin(x[rows]), full[rows])


def test_shapes_strides_and_bad_arguments():
    x, w, b = _case(6, 20, 10, True, seed=2)
    lin = PackedLinear(w, b)
    want = lin(x)
    assert torch.equal(lin(x.view(2, 3, 20)), want.view(2, 3, 10))
    wide = torch.zeros(6, 50)
    wide[:, 10:30] = x
    assert torch.equal(lin(wide[:, 10:30]), want)           # rows 50 apart
    assert lin(x[:0]).shape == (0, 10)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        PackedLinear([[1.0]])
    with pytest.raises(ValueError, match="2-D fp32 or bf16 CPU"):
        PackedLinear(w.double())
    with pytest.raises(ValueError, match="bias of the weight's dtype"):
        PackedLinear(w.bfloat16(), b)
    with pytest.raises(ValueError, match="bias must have 10"):
        PackedLinear(w, torch.zeros(9))
    with pytest.raises(ValueError, match="non-empty"):
        PackedLinear(torch.zeros(0, 4))
    with pytest.raises(ValueError, match=r"\[\.\.\., 20\]"):
        lin(torch.randn(3, 21))
    with pytest.raises(ValueError, match="torch.float32 on the CPU"):
        lin(x.half())
    with pytest.raises(ValueError, match="torch.bfloat16 on the CPU"):
        PackedLinear(w.bfloat16())(x)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_weight_too_big_for_the_cache_gives_the_same_bits(threads):
    """A packed weight above 16 MiB (here 8200 x 520, 17.1 MB) at >= threads x 96 rows takes the
    other work order (each thread streams the weight once over its share of the rows): the
    values match the reference, every body gives the same bits, and a row's result is the same
    alone, in any batch and at any thread count."""
    x, w, b = _case(230, 520, 8200, True, seed=5)
    lin = PackedLinear(w, b)
    assert lin.packed.numel() * 4 > 16 << 20
    torch.set_num_threads(threads)      # conftest restores the thread count
    full = lin(x)
    torch.testing.assert_close(full.double(), ref_linear(x.double(), w, b), rtol=1e-5,
                               atol=1e-5 * 520 ** 0.5)
    for isa in HERE:
        if isa != "portable":           # the plain loops would take seconds here
            assert torch.equal(lin(x, isa=isa), full), isa
    torch.set_num_threads(3 - threads)
    assert torch.equal(lin(x), full)
    for rows in (slice(0, 1), slice(3, 200), slice(100, 230)):
        assert torch.equal(lin(x[rows]), full[rows])


def test_run_unchecked_writes_into_out():
    x, w, b = _case(7, 24, 40, True, seed=6)
    lin = PackedLinear(w, b)
    out = torch.full((7, 40), float("nan"))
    y = lin.run_unchecked(x, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, lin(x))
    for bad in (torch.empty(7, 41), torch.empty(6, 40), torch.empty(7, 40).double(),
                torch.empty(40, 7).t()):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 CPU tensor of shape \[7, 40\]"):
            lin.run_unchecked(x, out=bad)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_registered_op_matches_reference_and_passes_opcheck(bias):
    x, w, b = _case(9, 37, 21, bias, seed=3)
    lin = PackedLinear(w, b)
    y = torch.ops.cb_kernels.linear(x.view(3, 3, 37), lin.packed, lin.bias, lin.n)
    assert y.shape == (3, 3, 21)
    assert torch.equal(y.view(9, 21), lin(x))
    torch.testing.assert_close(y.view(9, 21).double(), ref_linear(x.double(), w, b), rtol=1e-5, atol=1e-5 * 37 ** 0.5)
    torch.library.opcheck(torch.ops.cb_kernels.linear.default, (x, lin.packed, lin.bias, lin.n))


def test_registered_op_checks_the_packing():
    x, w, _ = _case(4, 16, 8, False, seed=4)
    lin = PackedLinear(w)
    with pytest.raises(ValueError, match=r"packed must be the contiguous 1-D packing of an \[40, 16\]"):
        torch.ops.cb_kernels.linear(x, lin.packed, None, 40)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        torch.ops.cb_kernels.linear(x, lin.packed, torch.zeros(7), 8)
    with pytest.raises(TypeError, match="x must be a float32 CPU"):
        torch.ops.cb_kernels.linear(x.double(), lin.packed, None, 8)


# ---- bf16 (csrc/cpu/linear_bf16.cpp): the vdpbf16ps body where the CPU has AVX512-BF16, the
# portable body everywhere; the result rule of cb_kernels/linear.h.
BF16_HERE = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512_bf16")]


def _bf16_rule(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """The documented sums in plain torch: fp32 over k pairs (odd element, then even), + bias,
    rounded to bf16 once."""
    xf, wf = x.float(), w.float()
    k = x.shape[1]
    acc = torch.zeros(x.shape[0], w.shape[0])
    for i in range(0, k, 2):
        if i + 1 < k:
            acc = acc + xf[:, i + 1:i + 2] * wf[:, i + 1][None]
        acc = acc + xf[:, i:i + 1] * wf[:, i][None]
    if b is not None:
        acc = acc + b.float()
    return acc.bfloat16()


@pytest.mark.parametrize("m, k, n, bias", [
    (1, 13, 7, False), (5, 64, 33, True), (16, 576, 96, True), (130, 101, 70, True),
    (12, 1, 32, False), (25, 3, 1, True),
])
def test_bf16_follows_its_rule_on_every_body(m, k, n, bias):
    x, w, b = _case(m, k, n, bias, seed=m + k + n)
    x, w, b = x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()
    lin = PackedLinear(w, b)
    want = _bf16_rule(x, w, b)
    for isa in BF16_HERE:
        y = lin(x, isa=isa)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert torch.equal(y, want), f"{isa}: {(y.float() - want.float()).abs().max()}"
    exact = ref_linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -7, atol=1e-2)
