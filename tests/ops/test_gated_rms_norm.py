"""gated_rms_norm (csrc/cpu/gated_rms_norm.cpp) against ops/reference.py's ref_gated_rms_norm and
transformers' own RMSNormGated modules (Qwen3-Next's per-head form, Mamba-2's grouped form), on
awkward sizes, strided rows, the runner's in-place z addressing, the registered op and bad inputs."""
import inspect

import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.gated_rms_norm import gated_rms_norm_unchecked
from cb_kernels.ops.reference import ref_gated_rms_norm

# fp32: another summation order than torch's mean; bf16: the same roundings, so equal up to a
# tie the fp32 difference tips (one bf16 ulp).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}
_BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# id: (rows, dim, group_size, weight_len)
CASES = {
    "qwen3-next-heads": (16, 512, 128, 128),
    "mamba2-one-group": (5, 512, 512, 512),
    "mamba2-groups-odd": (3, 180, 60, 180),
    "tiny-tails": (7, 21, 7, 7),
}


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("isa", _BODIES)
@DTYPES
@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["norm-first", "gate-first"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, norm_before_gate, dtype, isa):
    rows, dim, gs, wl = CASES[case]
    x, g, w = _r(rows, dim, dtype=dtype), _r(rows, dim, seed=1, dtype=dtype), _r(wl, seed=2, dtype=dtype)
    got = ops.gated_rms_norm(x, g, w, 1e-6, group_size=gs, norm_before_gate=norm_before_gate,
                             isa=isa)
    want = ref_gated_rms_norm(x, g, w, 1e-6, group_size=gs, norm_before_gate=norm_before_gate)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@DTYPES
def test_matches_transformers_modules(dtype):
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    q = Qwen3NextRMSNormGated(128, eps=1e-6).to(dtype)
    # transformers 5.17 (the CI floor) normalises Mamba-2's gated norm over the whole width; 5.24
    # takes group_size
    grouped = "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters
    gs = 128 if grouped else 384
    m = (MambaRMSNormGated(384, group_size=gs, eps=1e-5) if grouped
         else MambaRMSNormGated(384, eps=1e-5)).to(dtype)
    with torch.no_grad():
        q.weight.copy_(_r(128, seed=5))
        m.weight.copy_(_r(384, seed=6))
    x, z = _r(6, 512, seed=7, dtype=dtype), _r(6, 512, seed=8, dtype=dtype)
    want = q(x.view(-1, 128), z.view(-1, 128)).view(6, 512)
    torch.testing.assert_close(ops.gated_rms_norm(x, z, q.weight.detach(), 1e-6, group_size=128),
                               want, **TOL[dtype])
    x, z = x[:, :384], z[:, :384]
    want = m(x, z)
    got = ops.gated_rms_norm(x, z, m.weight.detach(), 1e-5, group_size=gs,
                             norm_before_gate=False)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_z_read_in_place_from_the_fused_projection():
    """The runner's addressing: z of value head h sits in key head h // r's block of the qkvz
    projection (q, k, v, z per key head), read without a copy."""
    n, nk, r, hk, hv = 5, 2, 3, 8, 16
    width = 2 * hk + 2 * r * hv
    qkvz = _r(n, nk, width, seed=3)
    z_view = qkvz[..., 2 * hk + r * hv:]                   # [n, nk, r * hv], strided
    x, w = _r(n, nk * r * hv, seed=4), _r(hv, seed=5)
    out = torch.empty(n, nk * r * hv)
    gated_rms_norm_unchecked(x, z_view, w, 1e-6, out, hv, True, gate_token_stride=nk * width,
                             gate_block_stride=width, groups_per_block=r)
    want = ref_gated_rms_norm(x, z_view.reshape(n, -1), w, 1e-6, group_size=hv)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_nan_and_inf_pass_through_as_torch():
    """The branch-free bf16 rounding keeps a NaN a NaN and an overflow an inf."""
    x = torch.randn(2, 16).to(torch.bfloat16)
    g = torch.randn(2, 16).to(torch.bfloat16)
    x[0, 3] = float("nan")
    w = torch.full((16,), 3e38).to(torch.bfloat16)
    for isa in _BODIES:
        got = ops.gated_rms_norm(x, g, w, 1e-6, group_size=16, norm_before_gate=False, isa=isa)
        want = ref_gated_rms_norm(x, g, w, 1e-6, group_size=16, norm_before_gate=False)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


def test_strided_rows_and_the_registered_op():
    x = _r(4, 3, 80)[..., :64]                              # rows 80 floats apart
    g = _r(4, 3, 70, seed=1)[..., :64]
    w = _r(32, seed=2)
    want = ref_gated_rms_norm(x, g, w, 1e-6, group_size=32)
    torch.testing.assert_close(ops.gated_rms_norm(x, g, w, 1e-6, group_size=32), want,
                               **TOL[torch.float32])
    got = torch.ops.cb_kernels.gated_rms_norm(x, g, w, 1e-6, 32, True)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_bad_inputs_name_the_argument():
    x, g, w = _r(2, 64), _r(2, 64, seed=1), _r(32, seed=2)
    with pytest.raises(ValueError, match="group_size"):
        ops.gated_rms_norm(x, g, w, 1e-6, group_size=24)
    with pytest.raises(ValueError, match="weight"):
        ops.gated_rms_norm(x, g, _r(16), 1e-6, group_size=32)
    with pytest.raises(TypeError, match="weight"):
        ops.gated_rms_norm(x, g, w.double(), 1e-6, group_size=32)
    with pytest.raises(ValueError, match="gate"):
        ops.gated_rms_norm(x, g[:1], w, 1e-6, group_size=32)
    with pytest.raises(TypeError, match="gate"):
        ops.gated_rms_norm(x, g.to(torch.bfloat16), w, 1e-6, group_size=32)
