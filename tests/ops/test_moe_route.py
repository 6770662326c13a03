"""moe_route (csrc/cpu/moe_route.cpp) against ops/reference.py's ref_moe_route (transformers'
router op for op) and transformers' Qwen3NextTopKRouter itself, fp32 and bf16, with and
without renormalisation, on awkward sizes, strided rows, ties, the registered op and bad inputs."""
import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_moe_route

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# libm's exp against torch's vectorised one: the weights agree to an ulp of fp32 (bf16: equal
# but where that ulp tips the rounding, one bf16 ulp)
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.bfloat16: dict(rtol=8e-3, atol=1e-4)}

# id: (num_tokens, num_experts, top_k)
CASES = {"decode-16x8-top2": (16, 8, 2), "qwen3-next-512-top10": (5, 512, 10),
         "odd-13x7-top3": (13, 7, 3), "all-experts": (3, 4, 4), "top1": (9, 6, 1),
         "threaded-128x512": (128, 512, 8), "no-tokens": (0, 8, 2)}


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@DTYPES
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, renormalize, dtype):
    n, e, k = CASES[case]
    logits = _r(n, e).to(dtype)
    w, ids = ops.moe_route(logits, k, renormalize=renormalize)
    want_w, want_ids = ref_moe_route(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (n, k)
    if dtype == torch.bfloat16:      # the values are bf16 ones
        assert torch.equal(w, w.to(torch.bfloat16).float())
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, **TOL[dtype])


@DTYPES
def test_matches_transformers_router(dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    cfg = Qwen3NextConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4)
    router = Qwen3NextTopKRouter(cfg).to(dtype)
    with torch.no_grad():
        router.weight.copy_(_r(16, 64, seed=1) * 0.1)
        x = _r(11, 64, seed=2).to(dtype)
        logits, want_w, want_ids = router(x)
    w, ids = ops.moe_route(logits, 4, renormalize=cfg.norm_topk_prob)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.float(), **TOL[dtype])


def test_strided_rows_and_ties():
    logits = _r(6, 20)[:, :8]                  # rows 20 apart
    w, ids = ops.moe_route(logits, 3)
    want_w, want_ids = ref_moe_route(logits.contiguous(), 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, **TOL[torch.float32])
    # tied values choose and order the experts as torch.topk does (bf16 logits tie often)
    for row, k in (([1.0, 2.0, 2.0, 0.0, 2.0], 2), ([3.0] * 7 + [1.0], 3),
                   ([0.5] * 600, 7), ([1.0, 0.0] * 300, 5)):
        tied = torch.tensor([row])
        w, ids = ops.moe_route(tied, k)
        want_w, want_ids = ref_moe_route(tied, k)
        assert torch.equal(ids, want_ids), (row[:8], k)
        torch.testing.assert_close(w, want_w, **TOL[torch.float32])


def test_registered_op():
    logits = _r(4, 8)
    got = torch.ops.cb_kernels.moe_route(logits, 2, True)
    want = ops.moe_route(logits, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.library.opcheck(torch.ops.cb_kernels.moe_route.default, (logits, 2, True))


@pytest.mark.parametrize("logits, k, match", [
    (_r(4, 8).half(), 2, "router_logits must be a float32 or bfloat16 CPU tensor"),
    (_r(8), 2, r"router_logits must be \[num_tokens, num_experts\]"),
    (_r(8, 4).t(), 2, "with the experts packed"),
    (_r(4, 8), 0, r"top_k must be an int in \[1, num_experts=8\]"),
    (_r(4, 8), 9, r"top_k must be an int in \[1, num_experts=8\]"),
    (_r(4, 8), 2.0, "top_k must be an int"),
], ids=["fp16", "1-d", "strided-experts", "k0", "k-too-big", "k-float"])
def test_bad_inputs_name_the_argument(logits, k, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ops.moe_route(logits, k)
