"""offset_rms_norm (csrc/cpu/offset_rms_norm.cpp) against ops/reference.py's ref_offset_rms_norm
and transformers' Qwen3NextRMSNorm, with and without the residual add, on awkward sizes, strided
rows, both CPU bodies, the registered op and bad inputs."""
import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.offset_rms_norm import offset_rms_norm_unchecked
from cb_kernels.ops.reference import ref_offset_rms_norm

# fp32: another summation order than torch's mean; bf16: one rounding as transformers', so
# equal up to a tie the fp32 difference tips (one bf16 ulp).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}
_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# id: (rows, dim); 4096 x 16 crosses the op's threading threshold
CASES = {"decode-16x256": (16, 256), "head-dim-128": (48, 128), "tails-7x21": (7, 21),
         "one-row": (1, 2048), "threaded": (16, 4096), "no-rows": (0, 64)}


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("isa", _BODIES)
@DTYPES
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, with_residual, dtype, isa):
    rows, dim = CASES[case]
    x, w = _r(rows, dim, dtype=dtype), _r(dim, seed=2, dtype=dtype) * 0.1
    res = _r(rows, dim, seed=1, dtype=dtype) if with_residual else None
    x_ref = x.clone()
    got = ops.offset_rms_norm(x, w, 1e-6, res, isa=isa)
    want = ref_offset_rms_norm(x_ref, w, 1e-6, res)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the residual add is written into x, rounded as torch's add in x's dtype: bit for bit
    assert torch.equal(x, x_ref)


@DTYPES
def test_matches_transformers_module(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = Qwen3NextRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_r(256, seed=5) * 0.2)
    h, res = _r(16, 256, seed=3, dtype=dtype), _r(16, 256, seed=4, dtype=dtype)
    with torch.no_grad():
        want = norm(res + h)
    x = h.clone()
    got = ops.offset_rms_norm(x, norm.weight.detach(), 1e-6, res)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, res + h)
    # exact where the sum of squares rounds alike: at least 95% of elements bit-equal in bf16
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.95


@DTYPES
def test_strided_rows_and_unchecked(dtype):
    # q of a fused q|gate projection: [tokens, heads, 2 * head_dim], the first half normed
    qg = _r(5, 4, 2 * 32, dtype=dtype)
    q = qg[..., :32]
    w = _r(32, seed=1, dtype=dtype)
    got = ops.offset_rms_norm(q, w, 1e-5)
    want = ref_offset_rms_norm(q.contiguous(), w, 1e-5)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert got.is_contiguous() and got.shape == q.shape
    x, res = _r(6, 64, dtype=dtype), _r(6, 64, seed=3, dtype=dtype)
    x2 = x.clone()
    torch.testing.assert_close(offset_rms_norm_unchecked(x, w.repeat(2), 1e-5, res),
                               ops.offset_rms_norm(x2, w.repeat(2), 1e-5, res), rtol=0, atol=0)


def test_registered_op_and_compile():
    x, w = _r(4, 64), _r(64, seed=1)
    res = _r(4, 64, seed=2)
    x1, x2 = x.clone(), x.clone()
    want = ops.offset_rms_norm(x1, w, 1e-6, res)
    got = torch.ops.cb_kernels.offset_rms_norm(x2, w, 1e-6, res)
    assert torch.equal(got, want) and torch.equal(x1, x2)
    torch.library.opcheck(torch.ops.cb_kernels.offset_rms_norm.default,
                          (x.clone(), w, 1e-6, res.clone()))


@pytest.mark.parametrize("bad, match", [
    (dict(weight=_r(32)), r"weight must be \[64\]"),
    (dict(weight=_r(64).to(torch.bfloat16)), "weight must be a contiguous 1-D CPU tensor"),
    (dict(residual=_r(3, 64)), "residual has 3 rows, x has 4"),
    (dict(residual=_r(4, 64).to(torch.bfloat16)), "residual must have the input's dtype"),
    (dict(x=_r(4, 64).to(torch.float16)), "x must be a float32 or bfloat16 CPU tensor"),
    (dict(x=_r(64, 4).t()), "x must be packed along its last dim"),
    (dict(eps=-1.0), "eps must be a non-negative number"),
], ids=["weight-len", "weight-dtype", "residual-rows", "residual-dtype", "x-fp16", "x-strided",
        "eps"])
def test_bad_inputs_name_the_argument(bad, match):
    args = dict(x=_r(4, 64), weight=_r(64, seed=1), eps=1e-6, residual=None)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        ops.offset_rms_norm(args["x"], args["weight"], args["eps"], args["residual"])
