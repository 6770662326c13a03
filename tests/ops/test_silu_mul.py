"""silu_mul (csrc/cpu/elementwise.cpp) against ops/reference.py's ref_silu_mul on odd sizes (vector
tails), large inputs (both exp branches), strided rows, the registered op, and the bad inputs."""
import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.reference import ref_silu_mul


def _r(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows, dim", [(1, 1536), (16, 1536), (700, 64), (4, 13)])
def test_matches_reference(rows, dim):
    gu = _r(rows, 2 * dim, scale=6.0)                           # large |x|: both exp branches
    torch.testing.assert_close(ops.silu_mul(gu), ref_silu_mul(gu), rtol=2e-6, atol=2e-6)


def test_strided_rows_and_leading_dims():
    gu = _r(2, 5, 70)[..., :64]                                 # rows 70 floats apart
    got = ops.silu_mul(gu)
    assert got.shape == (2, 5, 32)
    torch.testing.assert_close(got, ref_silu_mul(gu), rtol=2e-6, atol=2e-6)


def test_registered_op_matches_reference_and_passes_opcheck():
    gu = _r(9, 26, scale=3.0)
    torch.testing.assert_close(torch.ops.cb_kernels.silu_mul(gu), ref_silu_mul(gu), rtol=2e-6, atol=2e-6)
    torch.library.opcheck(torch.ops.cb_kernels.silu_mul.default, (gu,))


def test_traces_under_torch_compile():
    gu = _r(3, 4, 40)
    compiled = torch.compile(ops.silu_mul, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(gu), ref_silu_mul(gu), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ops.silu_mul(_r(3, 7)), ValueError, "gate_up's last dim must be even"),
    (lambda: ops.silu_mul(_r(3, 8).half()), TypeError, "gate_up must be a float32 or bfloat16 CPU"),
    (lambda: ops.silu_mul(_r(8, 4).t()), ValueError, "gate_up must be"),
    (lambda: ops.silu_mul(None), TypeError, "gate_up must be a torch.Tensor"),
], ids=["odd", "dtype", "column-strided", "not-a-tensor"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


# Every body this CPU runs above the portable one: the avx512_bf16 body (16 lanes, hardware bf16
# rounding) must give the avx2 body's bits, special values included.
_BODIES = [isa for isa in _C.cpu_isas() if isa in ("avx2", "avx512_bf16")]
_SPECIAL = [float("nan"), float("inf"), -float("inf"), 1e-39, -1e-39, 1e-45, 0.0, -0.0, 88.0,
            -88.0, -100.0, 100.0, 1e38, -1e38, 3e38, -3e38, 2.0 ** -126, -(2.0 ** -127)]


@pytest.mark.parametrize("isa", [b for b in _BODIES if b != "avx2"] or ["avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, dim", [(16, 1536), (3, 1544), (2, 13), (700, 64)])
def test_every_body_gives_the_avx2_bits(isa, dtype, rows, dim):
    gu = _r(rows, 2 * dim, scale=6.0, seed=5)
    n = min(dim, len(_SPECIAL))
    gu[0, :n] = torch.tensor(_SPECIAL[:n])
    gu[-1, dim:dim + n] = torch.tensor(_SPECIAL[:n])                # in `up` too
    gu = gu.to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    want = ops.silu_mul(gu, isa="avx2").view(bits)
    assert torch.equal(ops.silu_mul(gu, isa=isa).view(bits), want)
    assert torch.equal(ops.silu_mul(gu).view(bits), want)             # the auto pick


# bf16 reads a table of round(silu(g)) built once for every body: every body, the portable one
# included, gives the same bits, and those are torch's bf16 silu for every bf16 value.
_BF16_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx2", "avx512_bf16")]


@pytest.mark.parametrize("isa", _BF16_BODIES)
def test_bf16_silu_of_every_bf16_value_is_torchs(isa):
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.ones_like(g)
    up[::7] = -3.0                      # and the product rounded once: round(silu(g) * up)
    gu = torch.cat([g, up]).view(1, -1)
    got = ops.silu_mul(gu, isa=isa)[0]
    want = ref_silu_mul(gu)[0]
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("isa", _BF16_BODIES)
@pytest.mark.parametrize("rows, dim", [(16, 1536), (3, 1544), (2, 13), (700, 64), (5, 8200)])
def test_bf16_bodies_give_the_same_bits(isa, rows, dim):
    gu = _r(rows, 2 * dim, scale=6.0, seed=7)
    n = min(dim, len(_SPECIAL))
    gu[0, :n] = torch.tensor(_SPECIAL[:n])
    gu[-1, dim:dim + n] = torch.tensor(_SPECIAL[:n])
    gu = gu.to(torch.bfloat16)
    want = ops.silu_mul(gu, isa="portable").view(torch.int16)
    assert torch.equal(ops.silu_mul(gu, isa=isa).view(torch.int16), want)
