"""ops.moe_block (csrc/cpu/moe_block.cpp): an MoE block (router, routed experts, shared expert
and its sigmoid gate) or a dense gated MLP in one call. It gives the bits of the separate calls
it replaces (ops.PackedLinear, silu_mul, moe_route, moe_experts, torch's sigmoid, mul_ and
add_) for every kind of block, ragged row counts, every body this CPU runs and one or two
threads; it matches ops/reference.py's ref_moe_block and transformers' own block; torch's
sigmoid is the scalar formula below `torch_scalar_rows` (what the engine relies on); the
registered op is the same computation; bad arguments raise naming the argument; its work
buffers go with ops.moe's release_workspaces."""
import pytest
import torch

from cb_kernels import _C
from cb_kernels.ops import moe as moe_ops
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.moe import PackedExperts, moe_experts, moe_route
from cb_kernels.ops.moe_block import moe_block, torch_scalar_rows
from cb_kernels.ops.reference import ref_moe_block
from cb_kernels.ops.silu_mul import silu_mul

pytestmark = pytest.mark.one_thread

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Against the float64 reference: fp32 sums in another order; bf16 every op rounded, a rounding
# boundary can move one step by 2^-8 and carry (as test_moe_experts.py's tolerances).
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
KINDS = ["qwen3-next", "no-shared-gate", "no-shared-expert", "dense"]


def bodies():
    """Every `isa` cap this CPU runs: each forces the best body of every kernel inside up to
    it (the linears: portable, avx2, avx512 / avx512_bf16; moe_experts: portable, avx512 /
    avx512_bf16; silu_mul: portable, avx2, avx512_bf16), so every body here runs."""
    caps = _C.cpu_isas()
    assert caps[0] == "portable"
    return caps


def weights(hidden, shared_inter, num_experts, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(gate_up=r(2 * shared_inter, hidden) * hidden ** -0.5,
                down=r(hidden, shared_inter) * shared_inter ** -0.5, gate=r(1, hidden),
                router=r(num_experts, hidden), e_gate_up=r(num_experts, 2 * inter, hidden) *
                hidden ** -0.5, e_down=r(num_experts, hidden, inter) * inter ** -0.5,
                x=torch.randn(300, hidden, generator=g).to(dtype))


def packed(w, kind):
    """moe_block's keyword arguments for `kind` over the weights `w`."""
    shared = kind != "no-shared-expert"
    args = dict(shared_gate_up=PackedLinear(w["gate_up"]) if shared else None,
                shared_down=PackedLinear(w["down"]) if shared else None)
    if kind != "dense":
        args.update(router=PackedLinear(w["router"]), top_k=2,
                    experts=PackedExperts(w["e_gate_up"], w["e_down"]))
    if kind == "qwen3-next":
        args["shared_gate"] = PackedLinear(w["gate"])
    return args


def separate(x, a, isa, scalar_sigmoid=False):
    """The engine's separate calls (runner/hybrid_layers.py's mlp before ops.moe_block)."""
    shared = None
    if a.get("shared_gate_up") is not None:
        shared = a["shared_down"](silu_mul(a["shared_gate_up"](x, isa=isa), isa=isa), isa=isa)
    if a.get("router") is None:
        return shared
    w, ids = moe_route(a["router"](x, isa=isa), a["top_k"])
    routed = moe_experts(x, ids, w, a["experts"], isa=isa)
    if shared is None:
        return routed
    if a.get("shared_gate") is not None:
        g = a["shared_gate"](x, isa=isa)
        # Past torch_scalar_rows torch vectorises its exp: the op's formula is its scalar loop,
        # which a one-row tensor at a time always takes.
        sig = torch.cat([g[i:i + 1].sigmoid() for i in range(len(g))]) if scalar_sigmoid \
            else g.sigmoid()
        shared.mul_(sig)
    return routed.add_(shared)


# (num_tokens, hidden, shared_inter, num_experts, inter): decode sizes up to the sigmoid's
# scalar bound, odd widths (bf16 pairs, partial panels), an empty step.
CASES = [
    pytest.param(1, 32, 16, 4, 24, id="one-row"),
    pytest.param(16, 64, 48, 8, 40, id="decode-16"),
    pytest.param(13, 33, 17, 5, 19, id="odd-dims"),
    pytest.param(31, 48, 32, 6, 16, id="rows-31"),
    pytest.param(16, 256, 128, 8, 128, id="bench-shape"),     # bench_hybrid.py's Qwen3-Next
    pytest.param(0, 32, 16, 4, 24, id="empty"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_tokens, hidden, shared_inter, num_experts, inter", CASES)
def test_same_bits_as_the_separate_calls(num_tokens, hidden, shared_inter, num_experts, inter,
                                         kind, dtype):
    w = weights(hidden, shared_inter, num_experts, inter, dtype, seed=num_tokens)
    a = packed(w, kind)
    x = w["x"][:num_tokens]
    assert num_tokens < torch_scalar_rows(dtype)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in bodies():
                y = moe_block(x, **a, isa=isa)
                assert y.shape == (num_tokens, hidden) and y.dtype == dtype
                assert torch.equal(y, separate(x, a, isa)), (threads, isa)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_large_steps_and_strided_rows_same_bits(kind, dtype):
    """A prefill-sized step (experts with several work items, threads splitting every GEMM) on
    rows with a stride: the separate calls' bits, the sigmoid by torch's scalar loop."""
    w = weights(40, 24, 3, 32, dtype, seed=9)
    a = packed(w, kind)
    x = torch.cat([w["x"], w["x"]], dim=1)[:, :40]        # rows 80 apart
    assert x.stride(0) == 80
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(moe_block(x, **a), separate(x.contiguous(), a, "auto", True))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference(kind, dtype):
    w = weights(48, 40, 6, 24, dtype, seed=2)
    a = packed(w, kind)
    x = w["x"][:19]
    shared = None if kind == "no-shared-expert" else (w["gate_up"], w["down"])
    routed = kind != "dense"
    want = ref_moe_block(x, shared, w["gate"] if kind == "qwen3-next" else None,
                         w["router"] if routed else None, 2,
                         experts=(w["e_gate_up"], w["e_down"]) if routed else None)
    torch.testing.assert_close(moe_block(x, **a).float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_sigmoid_is_its_scalar_loop_below_the_bound(dtype):
    """What runner/hybrid_layers.py relies on to send steps of fewer rows to the op: torch's
    sigmoid of a contiguous [rows, 1] tensor equals its one-element results row by row."""
    g = (torch.randn(4096, 1, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    bound = torch_scalar_rows(dtype)
    one_by_one = torch.cat([g[i:i + 1].sigmoid() for i in range(len(g))])
    for start in range(0, len(g) - bound, bound):
        assert torch.equal(g[start:start + bound - 1].sigmoid(), one_by_one[start:start + bound - 1])


def test_equals_transformers_block():
    """A real Qwen3NextSparseMoeBlock (fp32): the op on its packed weights gives its forward
    (to fp32 rounding: transformers' GEMMs sum in another order)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=64, moe_intermediate_size=32, num_experts=6,
                          num_experts_per_tok=2, shared_expert_intermediate_size=48)
    block = Qwen3NextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(11, 64)
    with torch.no_grad():
        want = block(x[None])[0]
    y = moe_block(x, PackedLinear(torch.cat([block.shared_expert.gate_proj.weight,
                                             block.shared_expert.up_proj.weight])),
                  PackedLinear(block.shared_expert.down_proj.weight),
                  shared_gate=PackedLinear(block.shared_expert_gate.weight),
                  router=PackedLinear(block.gate.weight), top_k=2,
                  renormalize=bool(block.gate.norm_topk_prob),
                  experts=PackedExperts(block.experts.gate_up_proj, block.experts.down_proj))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_registered_op_is_the_same_computation():
    w = weights(32, 16, 4, 24, torch.float32, seed=6)
    a = packed(w, "qwen3-next")
    x = w["x"][:9]
    e = a["experts"]
    y = torch.ops.cb_kernels.moe_block(x, a["shared_gate_up"].packed, a["shared_down"].packed,
                                       a["shared_gate"].packed, a["router"].packed, e.gate_up,
                                       e.down, 16, 4, 24, 2, True)
    assert torch.equal(y, moe_block(x, **a))
    dense = torch.ops.cb_kernels.moe_block(x, a["shared_gate_up"].packed, a["shared_down"].packed,
                                           None, None, None, None, 16, 0, 0, 0, True)
    assert torch.equal(dense, moe_block(x, a["shared_gate_up"], a["shared_down"]))
    with pytest.raises(ValueError, match="router must be the contiguous"):
        torch.ops.cb_kernels.moe_block(x, None, None, None, a["router"].packed[1:], e.gate_up,
                                       e.down, 0, 4, 24, 2, True)
    torch.library.opcheck(torch.ops.cb_kernels.moe_block.default,
                          (x, a["shared_gate_up"].packed, a["shared_down"].packed,
                           a["shared_gate"].packed, a["router"].packed, e.gate_up, e.down, 16, 4,
                           24, 2, True))


def test_bad_arguments_raise_naming_them():
    w = weights(32, 16, 4, 24, torch.float32, seed=7)
    a = packed(w, "qwen3-next")
    x = w["x"][:4]
    with pytest.raises(ValueError, match="x must be a \\[num_tokens, hidden\\]"):
        moe_block(x[0], **a)
    with pytest.raises(TypeError, match="x must be a float32 or bfloat16 CPU"):
        moe_block(x.half(), **a)
    with pytest.raises(ValueError, match="unit column stride"):
        moe_block(x.t().contiguous().t(), **a)
    with pytest.raises(TypeError, match="router must be an ops.PackedLinear"):
        moe_block(x, **{**a, "router": w["router"]})
    with pytest.raises(ValueError, match="shared_down must have x's dtype"):
        moe_block(x, **{**a, "shared_down": PackedLinear(w["down"].bfloat16())})
    with pytest.raises(ValueError, match="both or neither"):
        moe_block(x, **{**a, "shared_down": None})
    with pytest.raises(ValueError, match="shared_down must be \\[32, 16\\]"):
        moe_block(x, **{**a, "shared_down": PackedLinear(w["down"][:, :8])})
    with pytest.raises(ValueError, match="shared_gate_up must be \\[2 \\* inter, 32\\]"):
        moe_block(x, **{**a, "shared_gate_up": PackedLinear(w["gate_up"][:31])})
    with pytest.raises(ValueError, match="shared_gate must be \\[1, 32\\]"):
        moe_block(x, **{**a, "shared_gate": PackedLinear(w["router"])})
    with pytest.raises(ValueError, match="shared_gate needs a shared expert and a router"):
        moe_block(x, a["shared_gate_up"], a["shared_down"], shared_gate=a["shared_gate"])
    with pytest.raises(TypeError, match="experts must be an ops.PackedExperts"):
        moe_block(x, **{**a, "experts": None})
    with pytest.raises(ValueError, match="router must be \\[4, 32\\]"):
        moe_block(x, **{**a, "router": PackedLinear(w["router"][:3])})
    with pytest.raises(ValueError, match="top_k must be an int in \\[1, num_experts=4\\]"):
        moe_block(x, **{**a, "top_k": 5})
    with pytest.raises(ValueError, match="needs a router \\(with experts\\) or a shared expert"):
        moe_block(x)
    with pytest.raises(ValueError, match="experts and top_k need a router"):
        moe_block(x, a["shared_gate_up"], a["shared_down"], top_k=2)


def test_work_buffers_go_with_release_workspaces():
    w = weights(64, 48, 4, 32, torch.float32, seed=8)
    a = packed(w, "no-shared-gate")
    moe_ops.release_workspaces()
    moe_block(w["x"][:40], **a)
    assert moe_ops.workspace_bytes() > 0
    assert moe_ops.release_workspaces() > 0 and moe_ops.workspace_bytes() == 0
