"""greedy_tokens (csrc/cpu/greedy_tokens.cpp) against ops/reference.py's ref_greedy_tokens
(torch.argmax), including ties, NaN, -inf rows, odd widths and strided rows; the registered op."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cb_kernels.ops import greedy_tokens
from cb_kernels.ops.reference import ref_greedy_tokens


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)      # noqa: E731
    tie = r(3, 1000)
    tie[:, 17] = 50.0
    tie[:, 901] = 50.0                                # the first of two equal maxima wins
    nan = r(4, 333)
    nan[1, 200] = float("nan")
    nan[1, 250] = float("nan")
    nan[2, 5] = float("nan")
    nan[3, 332] = float("nan")                        # NaN in the scalar tail
    inf = torch.full((2, 100), float("-inf"))
    inf[1, 64] = float("inf")
    tail = r(5, 70)
    tail[:, 66] = 9.0                                 # the max in the tail past the vector loop
    wide = r(40, 32000)
    many_ties = torch.randint(0, 3, (64, 999), generator=g).float()   # the max repeats in every lane
    return [
        ("one-row", r(1, 32000)), ("one-col", r(6, 1)), ("narrow-31", r(7, 31)),
        ("vector-tail", tail), ("ties", tie), ("many-ties", many_ties), ("nan", nan), ("all-minus-inf", inf),
        ("wide-parallel", wide), ("strided-rows", r(8, 700)[:, :512]), ("empty-rows", r(0, 10)),
        ("column-strided", r(512, 6).t()),
        ("expanded-rows", r(1, 300).expand(4, 300)),        # row stride 0: rows overlap
    ]


@pytest.mark.parametrize("logits", [c[1] for c in _cases()], ids=[c[0] for c in _cases()])
def test_matches_reference(logits):
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, ref_greedy_tokens(logits))


def test_reference_is_the_first_max_with_nan_largest():
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 9.0, float("nan")], [-1.0, -1.0, -2.0]])
    assert ref_greedy_tokens(x).tolist() == [1, 0, 0]


def test_other_dtypes_fall_back_to_torch():
    x = torch.randn(4, 50, dtype=torch.bfloat16)
    assert torch.equal(greedy_tokens(x), ref_greedy_tokens(x))


@pytest.mark.parametrize("logits", [c[1] for c in _cases()[:6]], ids=[c[0] for c in _cases()[:6]])
def test_registered_op_matches_reference_and_passes_opcheck(logits):
    assert torch.equal(torch.ops.cb_kernels.greedy_tokens(logits), ref_greedy_tokens(logits))
    torch.library.opcheck(torch.ops.cb_kernels.greedy_tokens.default, (logits,))


def test_registered_op_fake_gives_the_shape():
    with FakeTensorMode():
        out = torch.ops.cb_kernels.greedy_tokens(torch.empty(5, 70))
        assert out.shape == (5,) and out.dtype == torch.int64
        with pytest.raises(ValueError, match="logits must be 2-D"):
            torch.ops.cb_kernels.greedy_tokens(torch.empty(70))


def test_traces_under_torch_compile():
    logits = torch.randn(6, 333)
    compiled = torch.compile(greedy_tokens, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(logits), ref_greedy_tokens(logits))


@pytest.mark.parametrize("bad, error, match", [
    ([1.0, 2.0], TypeError, "logits must be a torch.Tensor"),
    (torch.randn(10), ValueError, "logits must be 2-D"),
    (torch.randn(3, 0), ValueError, "at least one column"),
], ids=["not-a-tensor", "1-d", "no-columns"])
def test_bad_input(bad, error, match):
    with pytest.raises(error, match=match):
        greedy_tokens(bad)
