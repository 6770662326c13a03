"""sample_tokens (csrc/cpu/sample_tokens.cpp) against ops/reference.py's ref_sample_tokens (the
sampler's earlier torch path: fp32 cumsum and searchsorted), each CPU body forced; the two
bodies give the same bits; the draw follows the inverse CDF exactly, does not depend on zero-mass
columns, the row's neighbours or the threads; non-finite rows; bad arguments; the registered op."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cb_kernels import _C
from cb_kernels.ops import sample_tokens
from cb_kernels.ops.reference import ref_sample_tokens

BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]
# logsumexp: the reference sums fp32 exps (its rounding grows with the width), the kernel exact
# integer masses; the logprobs differ by that and a few ulps of exp.
TOL = 2e-5


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)      # noqa: E731
    masked = r(6, 500)
    masked[:, ::3] = -float("inf")                   # top-k style -inf columns
    peaked = r(5, 777) * 0.1
    peaked[:, 400] = 30.0                            # almost all the mass on one column
    flat = torch.zeros(4, 1000)                      # every column the same mass
    return [
        ("one-col", r(5, 1), None), ("narrow-33", r(7, 33) * 3, None),
        ("vector-tail-70", r(9, 70) * 2, 0.7), ("block-tail-300", r(8, 300) * 4, 1.7),
        ("masked", masked, 0.9), ("peaked", peaked, None), ("flat", flat, 1.3),
        ("vocab-49152", r(12, 49152) * 3, None), ("vocab-49152-t", r(12, 49152) * 3, 0.6),
        ("strided", r(6, 900)[:, :700] * 2, None),
    ]


CASES = _cases()


def _args(x, temperature, seed=1):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(x.shape[0], generator=g).clamp(1e-7, 1 - 1e-7)
    t = None if temperature is None else torch.full((x.shape[0],), temperature) + \
        torch.rand(x.shape[0], generator=g) * 0.2
    return u, t


@pytest.mark.parametrize("name, x, temperature", CASES, ids=[c[0] for c in CASES])
def test_each_body_against_the_reference(name, x, temperature):
    u, t = _args(x, temperature)
    want = ref_sample_tokens(x, u, t)
    outs = {isa: sample_tokens(x, u, t, isa=isa) for isa in BODIES}
    for isa, (tokens, logprobs, lse) in outs.items():
        assert torch.equal(tokens, want[0]), f"{isa}: {tokens.tolist()} vs {want[0].tolist()}"
        assert torch.allclose(logprobs, want[1], atol=TOL, rtol=1e-6), \
            f"{isa}: {(logprobs - want[1]).abs().max()}"
        assert torch.allclose(lse, want[2], atol=TOL, rtol=1e-6), \
            f"{isa}: {(lse - want[2]).abs().max()}"
        for a, b in zip((tokens, logprobs, lse), outs[BODIES[0]]):
            assert torch.equal(a, b), f"{isa} differs from {BODIES[0]}"


@pytest.mark.parametrize("isa", BODIES)
def test_the_draw_is_the_inverse_cdf(isa):
    """Masses 1 : 2 : 3 : 4 (so cumulative 0.1, 0.3, 0.6, 1.0): u picks its interval."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log().expand(8, 4).contiguous()
    u = torch.tensor([0.01, 0.09, 0.11, 0.29, 0.31, 0.59, 0.61, 0.99])
    tokens, logprobs, lse = sample_tokens(x, u, isa=isa)
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.allclose(lse, torch.full((8,), math.log(10 / 4)), atol=1e-6)
    want = torch.tensor([1.0, 1, 2, 2, 3, 3, 4, 4]).div(10).log()
    assert torch.allclose(logprobs, want, atol=1e-6)
    # temperature 2 flattens to sqrt masses: 1, 1.414, 1.732, 2 (cumulative 0.163, 0.395, 0.678)
    tokens, _, _ = sample_tokens(x, torch.tensor([0.16, 0.17, 0.39, 0.40, 0.67, 0.68, 0.7, 0.02]),
                                 torch.full((8,), 2.0), isa=isa)
    assert tokens.tolist() == [0, 1, 1, 2, 2, 3, 3, 0]


@pytest.mark.parametrize("isa", BODIES)
def test_zero_mass_columns_change_nothing(isa):
    """A row over its k candidates (in column order) and the same row over the whole width with
    -inf elsewhere: the same column and bits, for 2000 uniforms (the sampler's top-k and
    whole-vocabulary paths rely on it)."""
    g = torch.Generator().manual_seed(3)
    width, keep = 3000, torch.sort(torch.randperm(3000, generator=g)[:40]).values
    full = torch.full((2000, width), -float("inf"))
    values = torch.randn(40, generator=g) * 2
    full[:, keep] = values
    u = torch.rand(2000, generator=g).clamp(1e-7, 1 - 1e-7)
    wide = sample_tokens(full, u, isa=isa)
    narrow = sample_tokens(values.expand(2000, 40).contiguous(), u, isa=isa)
    assert torch.equal(keep[narrow[0]], wide[0])
    assert torch.equal(narrow[1], wide[1]) and torch.equal(narrow[2], wide[2])
    assert len(set(narrow[0].tolist())) > 20            # the uniforms spread over the candidates


def test_rows_do_not_depend_on_neighbours_or_threads():
    x, _ = CASES[7][1], None
    u, t = _args(x, 0.8, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sample_tokens(x, u, t)
        alone = [sample_tokens(x[i:i + 1], u[i:i + 1], t[i:i + 1]) for i in range(x.shape[0])]
        torch.set_num_threads(2)
        two = sample_tokens(x, u, t)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    for k in range(3):
        assert torch.equal(torch.cat([a[k] for a in alone]), one[k])


@pytest.mark.parametrize("isa", BODIES)
def test_non_finite_rows(isa):
    x = torch.randn(5, 100)
    x[0, 37] = float("nan")
    x[0, 60] = float("nan")
    x[1, 99] = float("inf")                          # in the vector tail of 100 = 6 x 16 + 4
    x[2] = -float("inf")
    x[3, :50] = -float("inf")                        # fine: half the row masked
    u = torch.full((5,), 0.5)
    tokens, logprobs, lse = sample_tokens(x, u, isa=isa)
    ref = ref_sample_tokens(x, u)
    assert tokens[:3].tolist() == [37, 99, 0] and torch.equal(tokens, ref[0])
    assert logprobs[:3].isnan().all() and lse[:3].isnan().all()
    assert logprobs[3:].isfinite().all() and tokens[3] >= 50


def test_other_dtypes_and_devices_take_the_reference():
    x, u = torch.randn(4, 300, dtype=torch.float64), torch.rand(4).clamp(1e-6, 1 - 1e-6)
    got, want = sample_tokens(x, u), ref_sample_tokens(x.float(), u)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: ([[1.0]], torch.rand(1), None), TypeError, "logits must be a torch.Tensor"),
    (lambda: (torch.randn(3), torch.rand(3), None), ValueError, "logits must be 2-D"),
    (lambda: (torch.randn(3, 0), torch.rand(3), None), ValueError, "1 to 2\\^22 columns"),
    (lambda: (torch.ones(3, 4, dtype=torch.int64), torch.rand(3), None), TypeError, "float tensor"),
    (lambda: (torch.randn(3, 4), torch.rand(2), None), ValueError, r"u must be \[num_rows=3\]"),
    (lambda: (torch.randn(3, 4), torch.rand(3).double(), None), TypeError, "u must be an fp32"),
    (lambda: (torch.randn(3, 4), torch.tensor([0.5, 1.0, 0.2]), None), ValueError, r"in \(0, 1\)"),
    (lambda: (torch.randn(3, 4), torch.tensor([0.5, 0.0, 0.2]), None), ValueError, r"in \(0, 1\)"),
    (lambda: (torch.randn(3, 4), torch.rand(3) * 0.5 + 0.1, torch.tensor([1.0, 0.0, 2.0])),
     ValueError, "temperature must be > 0"),
    (lambda: (torch.randn(3, 4), torch.rand(3) * 0.5 + 0.1, torch.ones(4)), ValueError,
     r"temperature must be \[num_rows=3\]"),
])
def test_bad_arguments_name_the_problem(make, exc, match):
    with pytest.raises(exc, match=match):
        sample_tokens(*make())


def test_an_isa_this_cpu_lacks_or_an_unknown_one_is_refused():
    x, u = torch.randn(2, 40), torch.full((2,), 0.5)
    with pytest.raises(ValueError, match="isa"):
        sample_tokens(x, u, isa="sse9")


def test_registered_op():
    x, u = torch.randn(5, 70), torch.rand(5).clamp(1e-6, 1 - 1e-6)
    t = torch.rand(5) + 0.5
    got = torch.ops.cb_kernels.sample_tokens(x, u, t)
    for a, b in zip(got, sample_tokens(x, u, t)):
        assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.cb_kernels.sample_tokens.default, (x, u, t))
    torch.library.opcheck(torch.ops.cb_kernels.sample_tokens.default, (x, u, None))
    with FakeTensorMode():
        tokens, logprobs, lse = torch.ops.cb_kernels.sample_tokens(torch.empty(5, 70),
                                                                   torch.empty(5), None)
    assert tokens.dtype == torch.int64 and tuple(tokens.shape) == (5,)
    assert logprobs.dtype == lse.dtype == torch.float32


@pytest.mark.parametrize("isa", BODIES)
def test_tokens_match_float64_arithmetic(isa):
    """Against the inverse CDF in float64 (exp and running sum), 256 rows of a wide vocabulary:
    the same token wherever the target is farther than 2e-7 of the row's mass from a column
    boundary (fp32 exp's error; the fp32-cumsum reference misses some of these: it gave another
    token for 1 of 512 SmolLM2-wide rows whose target sat 2.5e-8 from a boundary)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 20000, generator=g) * 3
    u = torch.rand(256, generator=g).clamp(1e-7, 1 - 1e-7)
    t = torch.rand(256, generator=g) + 0.5
    tokens = sample_tokens(x, u, t, isa=isa)[0]
    y = ((x - x.amax(-1, keepdim=True)) / t[:, None]).double()
    cum = y.exp().cumsum(-1)
    target = u.double()[:, None] * cum[:, -1:]
    exact = torch.searchsorted(cum, target, right=True)[:, 0]
    lo = torch.where(exact > 0, cum.gather(1, (exact - 1).clamp(min=0)[:, None])[:, 0],
                     torch.zeros(256, dtype=torch.float64))
    hi = cum.gather(1, exact[:, None])[:, 0]
    margin = torch.minimum(target[:, 0] - lo, hi - target[:, 0]) / cum[:, -1]
    clear = margin > 2e-7
    assert clear.sum() > 240
    assert torch.equal(tokens[clear], exact[clear])
