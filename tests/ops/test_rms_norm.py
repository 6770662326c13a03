"""rms_norm (csrc/cpu/elementwise.cpp) against ops/reference.py's ref_rms_norm on odd sizes (vector
tails), strided rows, the residual added in place, the registered op, and the bad inputs."""
import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_rms_norm


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows, dim", [(1, 576), (16, 576), (5, 37), (300, 256), (3, 8)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(rows, dim, with_residual):
    x, w, res = _r(rows, dim, seed=1), _r(dim, seed=2), _r(rows, dim, seed=3)
    x_ref = x.clone()
    want = ref_rms_norm(x_ref, w, 1e-5, residual=res if with_residual else None)
    got = ops.rms_norm(x, w, 1e-5, residual=res if with_residual else None)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)       # x += residual, in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_leading_dims():
    x = _r(2, 6, 40)[..., :32]                                  # rows 40 floats apart
    w = _r(32, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_unchecked_hot_path_matches_checked():
    x, w, res = _r(7, 64), _r(64, seed=1), _r(7, 64, seed=2)
    x2 = x.clone()
    want = ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(ops.rms_norm_unchecked(x2, w, 1e-5, residual=res), want)
    assert torch.equal(x2, x)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_registered_op_matches_reference_and_passes_opcheck(with_residual):
    x, w, res = _r(5, 37), _r(37, seed=1), _r(5, 37, seed=2) if with_residual else None
    x_ref = x.clone()
    want = ref_rms_norm(x_ref, w, 1e-5, residual=res)
    got = torch.ops.cb_kernels.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.cb_kernels.rms_norm.default, (_r(5, 37), w, 1e-5, res))


def test_traces_under_torch_compile():
    x, w, res = _r(6, 48), _r(48, seed=1), _r(6, 48, seed=2)
    x_ref = x.clone()
    want = ref_rms_norm(x_ref, w, 1e-5, residual=res)
    compiled = torch.compile(lambda a, b, c: ops.rms_norm(a, b, 1e-5, residual=c), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x, w, res), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ops.rms_norm(_r(3, 8).double(), _r(8), 1e-5), TypeError, "x must be a float32 or bfloat16 CPU"),
    (lambda: ops.rms_norm(_r(3, 8), _r(7), 1e-5), ValueError, "weight must end in 8"),
    (lambda: ops.rms_norm(_r(3, 8), _r(2, 8), 1e-5), ValueError, r"weight must be \[8\]"),
    (lambda: ops.rms_norm(_r(3, 8), _r(8), 1e-5, residual=_r(2, 8)), ValueError, "residual has 2 rows"),
    (lambda: ops.rms_norm(_r(8, 3).t(), _r(8), 1e-5), ValueError, "x must be"),
    (lambda: ops.rms_norm([1.0], _r(8), 1e-5), TypeError, "x must be a torch.Tensor"),
], ids=["dtype", "weight-dim", "weight-2d", "residual-rows", "column-strided", "not-a-tensor"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()
