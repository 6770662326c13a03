"""paged_attention with attention sinks (one learned logit per q head in every softmax, value row
zero: gpt-oss): each backend against ops/reference.py, the reference against a softmax written
out by hand, and the inputs it refuses."""
from __future__ import annotations

import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_paged_attention
from paged_attention_cases import CASES, build, kwargs

# Decodes (the long one runs split partitions and their merge), prefill chunks, a window, a
# softcap and GQA 3; large positive sinks too, where the sink takes most of the mass.
CASE_IDS = ["mixed-gqa4-d64-bs16", "long-decode-2100", "window-50", "softcap-5",
            "bf16-window-softcap-gqa3", "d60-odd-dim"]
# Under the Triton interpreter: the split decode and its merge, and a prefill with an odd
# head_dim (each case compiles and interprets for seconds).
INTERPRETED = {"d60-odd-dim", "long-decode-2100"}
BY_ID = {c.id: c for c in CASES}


def sinks_for(num_heads: int, shift: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(num_heads, generator=g) * 2.0 + shift


def require(backend: str) -> None:
    name = "cpu" if backend == "cpu-portable" else backend
    if name not in ops.available_backends():
        pytest.skip(f"backend {name!r} is not available here ({ops.available_backends()})")


GPU = torch.cuda.is_available()


# Triton runs twice: compiled on a GPU (marked gpu, so bench/gpu_check.sh's `pytest -m gpu`
# selects it) and under the interpreter where there is none.
@pytest.mark.parametrize("shift", [0.0, 6.0], ids=["sinks", "large-sinks"])
@pytest.mark.parametrize("case_id", CASE_IDS)
@pytest.mark.parametrize("backend", ["cpu",
                                     pytest.param("triton", id="triton-interpreted"),
                                     pytest.param("triton", marks=pytest.mark.gpu, id="triton-gpu"),
                                     pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sinks_match_reference(request, backend, case_id, shift):
    require(backend)
    case = BY_ID[case_id]
    gpu = GPU and backend != "cpu"
    if "triton-interpreted" in request.node.callspec.id:
        if GPU:
            pytest.skip("a GPU is here: Triton runs compiled (the triton-gpu case)")
        if case_id not in INTERPRETED or shift == 0.0:
            pytest.skip("the Triton interpreter runs the INTERPRETED cases with large sinks only")
    args = build(case, device="cuda" if gpu else "cpu")
    sinks = sinks_for(case.num_heads, shift).to(args[0].device)
    out = ops.paged_attention(*args, **kwargs(case), sinks=sinks, backend=backend).cpu()
    expected = ref_paged_attention(*args, **kwargs(case), sinks=sinks).cpu()
    plain = ref_paged_attention(*args, **kwargs(case)).cpu()
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **case.tolerance)
    if shift > 0:   # large sinks visibly change the result (else this test could not fail)
        assert (expected.float() - plain.float()).abs().max() > 0.1


def test_reference_sinks_by_hand():
    """One sequence of 3 keys, one head: softmax over [s0, s1, s2, sink], value of the sink 0."""
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[2.0, 0.0]]])
    v = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    k_cache, v_cache = k.view(1, 3, 1, 2), v.view(1, 3, 1, 2)
    sink = torch.tensor([0.5])
    out = ref_paged_attention(q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32),
                              torch.tensor([3], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), scale=1.0, sinks=sink)
    w = torch.tensor([1.0, 0.0, 2.0, 0.5]).exp()
    w = w / w.sum()
    want = w[0] * v[0, 0] + w[1] * v[1, 0] + w[2] * v[2, 0]
    torch.testing.assert_close(out[0, 0], want)


BAD = [
    ("dtype", lambda h: torch.zeros(h, dtype=torch.float64), TypeError, "sinks"),
    ("shape", lambda h: torch.zeros(h + 1), ValueError, "one logit per q head"),
    ("ndim", lambda h: torch.zeros(1, h), ValueError, "sinks"),
]


@pytest.mark.parametrize("make,error,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_sinks_raise_naming_them(make, error, words):
    case = BY_ID["d60-odd-dim"]
    args = build(case)
    with pytest.raises(error, match=words):
        ops.paged_attention(*args, sinks=make(case.num_heads), backend="cpu")

