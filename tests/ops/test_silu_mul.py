"""silu_mul (csrc/cpu/elementwise.cpp) against ops/reference.py's ref_silu_mul on odd sizes (vector
tails), large inputs (both exp branches), strided rows, the registered op, and the bad inputs."""
import pytest
import torch

from cb_kernels import ops
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
