"""ops.moe_experts (csrc/cpu/moe_experts.cpp): the routed experts of an MoE layer in one call on
packed expert weights. Every body this CPU runs (fp32: portable, avx512; bf16: portable,
avx512_bf16) matches ops/reference.py's ref_moe_experts; a token's result does not depend on the
other tokens or the thread count (same bits); the op gives transformers' own experts forward
(grouped_mm) on a real experts module; bad arguments raise naming the argument; the registered
op `cb_kernels::moe_experts` is the same computation."""
import pytest
import torch

from cb_kernels import _C
from cb_kernels.ops.moe import PackedExperts, moe_experts
from cb_kernels.ops.reference import ref_moe_experts
from tests.helpers import assert_same_at_threads

pytestmark = pytest.mark.one_thread

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# fp32: the op's sums run in another order than float64 (rtol ~ fp32 rounding over k); bf16:
# both round every step to bf16, so one bf16 step (2^-8 relative) can differ where a sum lands
# on a rounding boundary, and it carries through the down projection.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def bodies(dtype):
    """The `isa` caps that force each body this CPU runs."""
    top = "avx512_bf16" if dtype == torch.bfloat16 else "avx512"
    caps = ["portable"] + ([top] if top in _C.cpu_isas() else [])
    assert [PackedExperts.isa(dtype, c) for c in caps] == caps
    return caps


def case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=g) * 2, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return x, ids, w.to(dtype).float(), gate_up, down


# (num_tokens, hidden, inter, num_experts, top_k): awkward sizes, odd k (bf16 pairs), partial
# register tiles and panels, an expert with more than one 64-row item, unused experts.
CASES = [
    pytest.param(1, 32, 16, 4, 2, id="one-token"),
    pytest.param(16, 40, 24, 5, 2, id="decode-16"),
    pytest.param(13, 33, 17, 3, 1, id="odd-dims-top1"),
    pytest.param(150, 64, 48, 2, 2, id="two-items-per-expert"),
    pytest.param(7, 48, 40, 16, 4, id="unused-experts"),
    pytest.param(0, 32, 16, 4, 2, id="empty"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", CASES)
def test_every_body_matches_the_reference(num_tokens, hidden, inter, num_experts, top_k, dtype):
    x, ids, w, gate_up, down = case(num_tokens, hidden, inter, num_experts, top_k, dtype)
    experts = PackedExperts(gate_up, down)
    want = ref_moe_experts(x, ids, w, gate_up, down)
    for isa in bodies(dtype):
        y = moe_experts(x, ids, w, experts, isa=isa)
        assert y.shape == (num_tokens, hidden) and y.dtype == dtype
        torch.testing.assert_close(y.float(), want.float(), **TOL[dtype], msg=isa)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_does_not_depend_on_the_batch_or_the_threads(dtype):
    x, ids, w, gate_up, down = case(200, 64, 96, 6, 2, dtype, seed=4)
    experts = PackedExperts(gate_up, down)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)                    # above the work gate: two threads split items
        batch = moe_experts(x, ids, w, experts)
        for t in (0, 77, 199):
            alone = moe_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], experts)
            assert torch.equal(alone[0], batch[t])
    finally:
        torch.set_num_threads(saved)
    assert_same_at_threads(lambda s: moe_experts(s, ids, w, experts), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_transformers_experts_forward(dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts

    cfg = Qwen3NextConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3NextExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 64 ** -0.5)
        module.down_proj.normal_(0, 48 ** -0.5)
    module = module.to(dtype)
    x, ids, w, _, _ = case(40, 64, 48, 8, 2, dtype, seed=5)
    with torch.inference_mode():
        want = module(x, ids, w.to(dtype))
    y = PackedExperts(module.gate_up_proj, module.down_proj)(x, ids, w)
    torch.testing.assert_close(y.float(), want.float(), **TOL[dtype])


def test_registered_op_is_the_same_computation():
    x, ids, w, gate_up, down = case(9, 32, 16, 4, 2, torch.float32, seed=6)
    experts = PackedExperts(gate_up, down)
    y = torch.ops.cb_kernels.moe_experts(x, ids, w, experts.gate_up, experts.down, 4, 16)
    assert torch.equal(y, moe_experts(x, ids, w, experts))
    with pytest.raises(ValueError, match="packed CPU tensors of 4 experts"):
        torch.ops.cb_kernels.moe_experts(x, ids, w, experts.gate_up[1:], experts.down, 4, 16)


def test_bad_arguments_raise_naming_them():
    x, ids, w, gate_up, down = case(4, 32, 16, 4, 2, torch.float32, seed=7)
    experts = PackedExperts(gate_up, down)
    with pytest.raises(ValueError, match="down_proj must be"):
        PackedExperts(gate_up, down[:, :, :8])
    with pytest.raises(ValueError, match="gate_up_proj must be"):
        PackedExperts(gate_up[:, :31], torch.zeros(4, 32, 15))
    with pytest.raises(ValueError, match="dtype"):
        PackedExperts(gate_up, down.bfloat16())
    with pytest.raises(ValueError, match="top_k_index must hold expert ids in \\[0, 4\\)"):
        moe_experts(x, torch.full_like(ids, 4), w, experts)
    with pytest.raises(TypeError, match="top_k_index must be a torch.int64"):
        moe_experts(x, ids.int(), w, experts)
    with pytest.raises(TypeError, match="top_k_weights must be a torch.float32"):
        moe_experts(x, ids, w.bfloat16(), experts)
    with pytest.raises(ValueError, match="top_k_weights"):
        moe_experts(x, ids, w[:, :1].contiguous(), experts)
    with pytest.raises(ValueError, match="hidden_states must be torch.float32"):
        moe_experts(x.bfloat16(), ids, w, experts)
    with pytest.raises(ValueError, match="hidden_states must be a \\[num_tokens, 32\\]"):
        moe_experts(x[:, :16], ids, w, experts)
    with pytest.raises(TypeError, match="experts must be a PackedExperts"):
        moe_experts(x, ids, w, (gate_up, down))
