"""The fused CPU passes of cb_kernels/ops/elementwise.py against torch, on odd sizes (vector
tails), strided rows and the bad inputs each names."""
import pytest
import torch
import torch.nn.functional as F

from cb_kernels.ops.elementwise import rms_norm, rope_, silu_mul

g = torch.Generator().manual_seed(0)


def _r(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def _ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows, dim", [(1, 576), (16, 576), (5, 37), (300, 256), (3, 8)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_torch(rows, dim, with_residual):
    x, w, res = _r(rows, dim), _r(dim), _r(rows, dim)
    want_x = x + res if with_residual else x.clone()
    got = rms_norm(x, w, 1e-5, residual=res if with_residual else None)
    torch.testing.assert_close(x, want_x, rtol=0, atol=0)       # x += residual, in place
    torch.testing.assert_close(got, _ref_rms(want_x, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_strided_rows_and_leading_dims():
    base = _r(2, 6, 40)
    x = base[..., :32]                                          # rows 40 floats apart
    w = _r(32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), _ref_rms(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, dim", [(1, 1536), (16, 1536), (700, 64), (4, 13)])
def test_silu_mul_matches_torch(rows, dim):
    gu = _r(rows, 2 * dim, scale=6.0)                           # large |x|: both exp branches
    want = F.silu(gu[:, :dim]) * gu[:, dim:]
    torch.testing.assert_close(silu_mul(gu), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens, heads, head_dim", [(16, 9, 64), (1, 2, 32), (7, 3, 18)])
def test_rope_matches_transformers_formula_in_place(tokens, heads, head_dim):
    qkv = _r(tokens, heads * head_dim + 5)
    x = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)   # a strided view, as the engine's
    cos, sin = _r(tokens, head_dim), _r(tokens, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    want = x * cos[:, None] + rotated * sin[:, None]
    out = rope_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda: rms_norm(_r(3, 8).double(), _r(8), 1e-5), TypeError, "x must be a float32 CPU"),
    (lambda: rms_norm(_r(3, 8), _r(7), 1e-5), ValueError, "weight must end in 8"),
    (lambda: rms_norm(_r(3, 8), _r(8), 1e-5, residual=_r(2, 8)), ValueError, "residual has 2 rows"),
    (lambda: rms_norm(_r(8, 3).t(), _r(8), 1e-5), ValueError, "x must be"),
    (lambda: silu_mul(_r(3, 7)), ValueError, "must be even"),
    (lambda: rope_(_r(3, 2, 7), _r(3, 7), _r(3, 7)), ValueError, "even head_dim"),
    (lambda: rope_(_r(3, 2, 8), _r(4, 8), _r(3, 8)), ValueError, "cos must be contiguous"),
], ids=["rms-dtype", "rms-weight", "rms-residual-rows", "rms-column-strided", "silu-odd",
        "rope-odd-dim", "rope-cos-shape"])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
