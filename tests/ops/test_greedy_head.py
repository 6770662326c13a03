"""GreedyHead (csrc/cpu/greedy_head.cpp): the argmax of hidden @ W.T from int8 scores plus exact
rescoring must be the argmax of the exact logits, on both bodies (VNNI where the CPU has it, and
the portable one), including near-ties the int8 scores cannot tell apart, exact ties, outlier
dimensions, odd shapes and weight updates."""
import pytest
import torch

from cb_kernels import _C
from cb_kernels.ops import GreedyHead
from cb_kernels.ops.reference import ref_greedy_head

BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512_vnni")]


def _random(vocab, hidden, rows, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, hidden, generator=g),
            torch.randn(vocab, hidden, generator=g) * scale)


@pytest.mark.parametrize("isa", BODIES)
@pytest.mark.parametrize("vocab, hidden, rows", [
    (32000, 256, 32),      # the tiny Llama's decode step
    (1000, 13, 7),         # hidden not a multiple of 4, vocab not of 64
    (65, 64, 1),           # one row; a tile with a single real row
    (4096, 576, 37),       # every remainder of the 4-row blocks
    (1, 8, 3),             # a one-token vocab
    (3000, 64, 150),       # three passes of up to 64 rows
])
def test_matches_reference(vocab, hidden, rows, isa):
    h, w = _random(vocab, hidden, rows, seed=vocab + hidden + rows)
    head = GreedyHead(w)
    got = head(h, isa=isa)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, ref_greedy_head(h, w))
    assert torch.equal(got, (h @ w.t()).argmax(-1))        # no near-tie in these: fp32 agrees
    # The bound prunes: on random data only a few logits per row need exact rescoring.
    assert rows <= head.num_rescored <= max(rows * 64, rows * vocab // 20)


@pytest.mark.parametrize("isa", BODIES)
def test_near_ties_below_int8_resolution(isa):
    """Pairs of vocab rows that differ by ~1e-6 of the logit: int8 scores are equal, the exact
    rescoring must still pick the larger (and on exact equality, the lower index)."""
    vocab, hidden, rows = 3000, 128, 6
    h, w = _random(vocab, hidden, rows, seed=1)
    base = ref_greedy_head(h, w)
    twins = [(int(a) * 7 + 11) % vocab for a in base]
    assert len(set(twins) | set(base.tolist())) == 2 * rows       # six distinct pairs
    for r in range(rows):
        a, twin = int(base[r]), twins[r]
        w[twin] = w[a]
        k = int(h[r].abs().argmax())               # nudge along the row's largest dimension
        w[twin, k] += 1e-6 * torch.sign(h[r, k]) * w[a].abs().max()
    want = ref_greedy_head(h, w)
    got = GreedyHead(w)(h, isa=isa)
    assert torch.equal(got, want)
    assert got.tolist() == twins          # each row's nudged twin, a hair above its original


@pytest.mark.parametrize("isa", BODIES)
def test_exact_ties_take_the_lowest_index(isa):
    h, w = _random(500, 40, 5, seed=2)
    w[:] = w[123]                          # every row the same: every logit equal
    assert GreedyHead(w)(h, isa=isa).tolist() == [0] * 5
    w2 = torch.randn(500, 40)
    zero = torch.zeros(3, 40)              # a zero hidden state: all logits 0
    assert GreedyHead(w2)(zero, isa=isa).tolist() == [0] * 3
    w3 = w2.clone()
    w3[400] = w3[77] = w3[300] * 50        # three equal large rows: the lowest index wins
    h3 = w3[77:78].clone()
    assert GreedyHead(w3)(h3, isa=isa).tolist() == [77]


@pytest.mark.parametrize("isa", BODIES)
def test_outlier_dimensions(isa):
    """Real LLM hidden states carry a few huge dimensions, which coarsen the int8 scale of the
    row: the bound widens, the answer must not change."""
    h, w = _random(8000, 192, 9, seed=3)
    h[:, 5] *= 300.0
    h[:, 77] *= -80.0
    w[:, 5] *= 0.01
    head, plain = GreedyHead(w), GreedyHead(w, max_exact_dims=0)
    got = head(h, isa=isa)      # finds the two dims: exact from the next call on
    assert torch.equal(got, ref_greedy_head(h, w))
    assert sorted(head.exact_dims[:head.num_exact].tolist()) == [5, 77]
    assert torch.equal(head(h, isa=isa), got)
    assert torch.equal(plain(h, isa=isa), got) and plain.num_exact == 0
    # Scored exactly, the two dims no longer coarsen every row's int8 scale.
    assert head.num_candidates * 4 < plain.num_candidates


@pytest.mark.parametrize("isa", BODIES)
def test_rising_logits_compact_the_candidates_and_rescore_few(isa):
    """Logits that rise along the vocab keep every row's running floor climbing tile after tile,
    so pass 1 keeps candidates that the final floor drops. The token stays exact,
    and the rescoring (largest bound first) stops before the last candidate the final floor
    keeps."""
    vocab, hidden, rows = 40000, 64, 3
    g = torch.Generator().manual_seed(7)
    u = torch.randn(hidden, generator=g)
    u /= u.norm()
    h = 4.0 * u + 0.3 * torch.randn(rows, hidden, generator=g)
    w = torch.linspace(0.0, 3.0, vocab)[:, None] * u + 0.05 * torch.randn(vocab, hidden, generator=g)
    head = GreedyHead(w)
    assert torch.equal(head(h, isa=isa), ref_greedy_head(h, w))
    assert head.num_fp32_rows == 0
    counts = (head.num_candidates, head.num_rescored)
    assert head.num_candidates > 64 and head.num_rescored < head.num_candidates, counts


def test_1b_head_rescores_a_few_logits_a_row():
    """The Llama-3.2-1B shape's head (vocab 128256, hidden 2048, bf16, std 0.02 as transformers
    initialises it) on Gaussian rows: a few hundred candidates a row, ~20 rescored, none left to
    the GEMM; the bf16 rule's token."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(128256, 2048, generator=g) * 0.02).bfloat16()
    h = torch.randn(4, 2048, generator=g).bfloat16()
    head = GreedyHead(w)
    exact = torch.cat([h.double() @ w[i:i + 16384].double().t() for i in range(0, 128256, 16384)], 1)
    assert torch.equal(head(h), exact.float().bfloat16().float().argmax(-1))
    counts = (head.num_candidates, head.num_rescored)
    assert head.num_fp32_rows == 0
    assert head.num_rescored < 100 * 4 and head.num_rescored * 4 < head.num_candidates, counts


@pytest.mark.parametrize("isa", BODIES)
def test_tiny_magnitudes_whose_int8_scale_would_be_subnormal(isa):
    """max|h| or max|w_j| below 127 x FLT_MIN: 127 / max overflows fp32, so a plain h * (127 /
    max) quantises 0 to -127 and every value to +-127, far past the half-step the bound assumes."""
    w = torch.tensor([[1e10, 0.0], [0.0, 1.1e10]])
    h = torch.tensor([[3e-37, 1e-37]])               # logits 3e-27 and 1.1e-27
    assert GreedyHead(w, max_exact_dims=0)(h, isa=isa).tolist() == [0]
    w = torch.tensor([[3e-37, 0.0], [1e-37, 1e-37]])
    h = torch.tensor([[1e10, 1e10]])                 # logits 3e-27 and 2e-27
    assert GreedyHead(w, max_exact_dims=0)(h, isa=isa).tolist() == [0]
    g = torch.Generator().manual_seed(12)
    for hs, ws in ((1e-38, 1e12), (1e-40, 1e14), (1e12, 1e-39)):
        h = torch.randn(5, 24, generator=g) * hs
        w = torch.randn(300, 24, generator=g) * ws
        w[::7] *= 1e-3                               # some rows far smaller than the rest
        assert torch.equal(GreedyHead(w, max_exact_dims=0)(h, isa=isa),
                           ref_greedy_head(h, w))


def test_outliers_reported_by_several_row_chunks_are_added_once():
    h, w = _random(2000, 96, 200, seed=10)     # 4 chunks of rows, each sees the same dims
    h[:, 3] *= 40.0
    h[150:, 50] *= 40.0
    head = GreedyHead(w)
    assert torch.equal(head(h), ref_greedy_head(h, w))
    assert sorted(head.exact_dims[:head.num_exact].tolist()) == [3, 50]
    assert torch.equal(head(h), ref_greedy_head(h, w))


def test_exact_dims_follow_a_weight_update():
    h, w = _random(3000, 64, 6, seed=9)
    h[:, 10] *= 50.0
    head = GreedyHead(w)
    assert torch.equal(head(h), ref_greedy_head(h, w)) and head.num_exact == 1
    assert torch.equal(head(h), ref_greedy_head(h, w))
    with torch.no_grad():
        w[:, 10].mul_(-3.0)               # the exact dim's column changes
    assert torch.equal(head(h), ref_greedy_head(h, w))


def test_strided_and_noncontiguous_hidden():
    h, w = _random(2000, 64, 12, seed=4)
    head = GreedyHead(w)
    wide = torch.randn(12, 100)
    wide[:, :64] = h
    assert torch.equal(head(wide[:, :64]), ref_greedy_head(h, w))
    assert torch.equal(head(h.t().contiguous().t()), ref_greedy_head(h, w))
    assert head(h[:0]).shape == (0,)


def test_weight_written_in_place_is_repacked():
    h, w = _random(3000, 32, 4, seed=5)
    head = GreedyHead(w)
    assert torch.equal(head(h), ref_greedy_head(h, w))
    with torch.no_grad():
        w.mul_(-1.0)                       # every argmax moves
    assert torch.equal(head(h), ref_greedy_head(h, w))
    w.data[:, :] = torch.randn(3000, 32)   # unseen by torch's version counter
    head.refresh(force=True)
    assert torch.equal(head(h), ref_greedy_head(h, w))


def test_non_finite_values_are_refused():
    h, w = _random(100, 16, 2, seed=6)
    head = GreedyHead(w)
    for bad in (float("nan"), float("inf")):
        hb = h.clone()
        hb[1, 3] = bad
        with pytest.raises(RuntimeError, match="not finite"):
            head(hb)
        wb = w.clone()
        wb[50, 2] = bad
        with pytest.raises(RuntimeError, match="non-finite"):
            GreedyHead(wb)


def test_huge_values_are_refused():
    h, w = _random(100, 16, 2, seed=11)
    hb = h.clone()
    hb[0, 0] = 1e16
    with pytest.raises(RuntimeError, match="1e15"):
        GreedyHead(w)(hb)
    wb = w.clone()
    wb[3, 3] = -1e16
    with pytest.raises(RuntimeError, match="1e15"):
        GreedyHead(wb)
    with pytest.raises(RuntimeError, match="65536"):
        GreedyHead(torch.zeros(2, 65537))


def test_bad_arguments():
    w = torch.randn(100, 16)
    head = GreedyHead(w)
    with pytest.raises(TypeError, match="torch.Tensor"):
        GreedyHead([[1.0]])
    with pytest.raises(ValueError, match="2-D"):
        GreedyHead(torch.randn(10))
    with pytest.raises(ValueError, match="fp32"):
        GreedyHead(w.half())
    with pytest.raises(ValueError, match="contiguous"):
        GreedyHead(torch.randn(16, 100).t())
    with pytest.raises(ValueError, match=r"\[rows, 16\]"):
        head(torch.randn(3, 17))
    with pytest.raises(ValueError, match="fp32"):
        head(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_exact_dims"):
        GreedyHead(w, max_exact_dims=65)


def test_weight_data_swapped_for_another_shape_or_dtype_is_refused():
    """`param.data = other` keeps the Parameter object but may change its shape or dtype: the
    repack must refuse it rather than read the new storage with the old sizes."""
    w = torch.nn.Parameter(torch.randn(3000, 64), requires_grad=False)
    head = GreedyHead(w)
    h = torch.randn(2, 64)
    assert torch.equal(head(h), ref_greedy_head(h, w))
    w.data = torch.randn(10, 64)
    with pytest.raises(ValueError, match=r"\[3000, 64\]"):
        head(h)
    w.data = torch.randn(3000, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32"):
        head(h)
    w.data = torch.randn(3000, 64)                 # the same shape again: repacked
    assert torch.equal(head(h), ref_greedy_head(h, w.data))


def _bf16_reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """argmax of the exact logits rounded to bf16, lowest index among equal bf16 values."""
    return (h.double() @ w.double().t()).float().bfloat16().float().argmax(-1)


@pytest.mark.parametrize("isa", BODIES)
@pytest.mark.parametrize("vocab, hidden, rows", [(49152, 576, 16), (5000, 64, 40), (333, 20, 3)])
def test_bf16_weight_gives_the_argmax_of_bf16_rounded_exact_logits(isa, vocab, hidden, rows):
    g = torch.Generator().manual_seed(vocab)
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    h = (torch.randn(rows, hidden, generator=g) * 2).bfloat16()
    got = GreedyHead(w)(h, isa=isa)
    assert torch.equal(got, _bf16_reference(h, w))
    # a bf16 GEMM's logits (fp32 accumulation, rounded to bf16) give the same tokens here
    assert torch.equal(got, torch.nn.functional.linear(h, w).float().argmax(-1))


@pytest.mark.parametrize("isa", BODIES)
def test_bf16_logits_in_one_bf16_value_take_the_lowest_index(isa):
    """Row 900's exact logit (2 + 2^-12) is above row 300's (2) but both round to bf16 2.0: the
    bf16 rule picks 300, where the exact maximum would be 900."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2000, 32, generator=g) * 0.01).bfloat16()
    h = torch.zeros(1, 32, dtype=torch.bfloat16)
    h[0, 0], h[0, 1] = 1.0, 2 ** -6
    w[300, :2] = torch.tensor([2.0, 0.0])
    w[900, :2] = torch.tensor([2.0, 2 ** -6])
    exact = h.double() @ w.double().t()
    assert exact[0, 900] > exact[0, 300] == exact.max(-1).values[0] - 2 ** -12
    assert exact[0, 900].float().bfloat16() == exact[0, 300].float().bfloat16()
    assert GreedyHead(w)(h, isa=isa).tolist() == [300] == _bf16_reference(h, w).tolist()
