"""The fused CPU passes (rms_norm, silu_mul, rope_) in bfloat16, every ISA body this CPU runs,
against ops/reference.py's formulas run in torch's bf16 ops (transformers' op chain: each op
computes in fp32 and rounds to bf16). The kernels round at the same places, so results agree to
one bf16 unit in the last place (fp32 summation order in the norm may move a value across a
rounding boundary; bf16 SiLU reads a table of torch's own roundings), and nearly all elements
are identical."""
import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.reference import ref_rms_norm, ref_rope_, ref_silu_mul

ISAS = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx2", "avx512_bf16")]


def _r(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor, min_identical: float = 0.98) -> None:
    """Each element within one bf16 ulp of the reference, and nearly all bit-identical."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    ulp = torch.where(w == 0, torch.full_like(w, 2.0 ** -133), w.abs() * 2.0 ** -7)
    assert bool(((g - w).abs() <= ulp).all()), f"max diff {(g - w).abs().max().item()}"
    same = (got.view(torch.int16) == want.view(torch.int16)).float().mean().item()
    assert same >= min_identical, f"only {same:.3f} of the elements are bit-identical"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, dim", [(16, 576), (5, 37), (3, 8)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_bf16(isa, rows, dim, with_residual):
    x, w, res = _r(rows, dim, seed=1, scale=3), _r(dim, seed=2), _r(rows, dim, seed=3)
    x_ref = x.clone()
    want = ref_rms_norm(x_ref, w, 1e-5, residual=res if with_residual else None)
    got = ops.rms_norm(x, w, 1e-5, residual=res if with_residual else None, isa=isa)
    assert torch.equal(x, x_ref)            # the residual add rounds as torch's bf16 add
    _within_one_ulp(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, dim", [(16, 1536), (3, 13)])
def test_silu_mul_bf16(isa, rows, dim):
    gate_up = _r(rows, 2 * dim, seed=4, scale=4)
    _within_one_ulp(ops.silu_mul(gate_up, isa=isa), ref_silu_mul(gate_up))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(16, 9, 64), (7, 3, 18)])
def test_rope_bf16_in_place(isa, num_tokens, num_heads, head_dim):
    qkv = _r(num_tokens, num_heads * head_dim + 6, seed=5)
    x = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=torch.Generator().manual_seed(6)) * 6
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    want = ref_rope_(x.clone(), cos, sin)
    ops.rope_(x, cos, sin, isa=isa)
    # the product and sum roundings are the same ops in the same order: identical bits
    assert torch.equal(x.view(torch.int16), want.view(torch.int16))


def test_bf16_matches_fp32_kernel_to_bf16_rounding():
    """The bf16 pass is the fp32 pass with roundings, not another formula."""
    x, w = _r(8, 64, seed=7), _r(64, seed=8)
    got = ops.rms_norm(x, w, 1e-6).float()
    want = ops.rms_norm(x.float(), w.float(), 1e-6)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda: ops.rms_norm(_r(3, 8), _r(8).float(), 1e-5), "weight must have the input's dtype"),
    (lambda: ops.rms_norm(_r(3, 8), _r(8), 1e-5, residual=_r(3, 8).float()),
     "residual must have the input's dtype"),
    (lambda: ops.rope_(_r(3, 2, 8), _r(3, 8).float(), _r(3, 8)), "cos must have x's dtype"),
    (lambda: ops.silu_mul(_r(3, 8).half()), "gate_up must be a float32 or bfloat16"),
], ids=["weight-dtype", "residual-dtype", "cos-dtype", "fp16"])
def test_mixed_or_unsupported_dtypes_raise_naming_the_argument(call, match):
    with pytest.raises(TypeError, match=match):
        call()


# The avx512_bf16 body's bf16 norm and rotary (16 lanes, hardware rounding) give the avx2 body's
# bits, subnormal and NaN lanes (which take the integer rounding) included.
_WIDE = [b for b in ISAS if b == "avx512_bf16"] or ["avx2"]
_ODD = [float("nan"), 1e-39, -1e-39, 2.0 ** -126, -(2.0 ** -127), 0.0, -0.0, 3e38, -3e38, 1e-20]


def _with_odd_values(t: torch.Tensor) -> torch.Tensor:
    flat = t.float().reshape(-1).clone()
    n = min(flat.numel(), len(_ODD))
    flat[:n] = torch.tensor(_ODD[:n])
    return flat.view(t.shape).bfloat16()


@pytest.mark.parametrize("isa", _WIDE)
@pytest.mark.parametrize("rows, dim", [(16, 2048), (3, 576), (5, 13), (7, 40), (2, 24)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_bf16_bodies_give_the_same_bits(isa, rows, dim, with_residual):
    x, w = _r(rows, dim, seed=11, scale=3.0), _r(dim, seed=12)
    res = _r(rows, dim, seed=13)
    x[1:] = _with_odd_values(x[1:]) if rows > 2 else x[1:]
    got_x, want_x = x.clone(), x.clone()
    got = ops.rms_norm(got_x, w, 1e-5, residual=res if with_residual else None, isa=isa)
    want = ops.rms_norm(want_x, w, 1e-5, residual=res if with_residual else None, isa="avx2")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_x.view(torch.int16), want_x.view(torch.int16))


@pytest.mark.parametrize("isa", _WIDE)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(16, 32, 64), (5, 3, 40), (3, 2, 18),
                                                             (2, 4, 128)])
def test_rope_bf16_bodies_give_the_same_bits(isa, num_tokens, num_heads, head_dim):
    x = _with_odd_values(_r(num_tokens, num_heads, head_dim, seed=14, scale=2.0))
    ang = torch.rand(num_tokens, head_dim // 2, generator=torch.Generator().manual_seed(15)) * 9
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16().contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16().contiguous()
    got, want = x.clone(), x.clone()
    ops.rope_(got, cos, sin, isa=isa)
    ops.rope_(want, cos, sin, isa="avx2")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
