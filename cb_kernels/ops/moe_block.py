"""A whole MoE block, or a dense gated MLP, in one call on packed weights
(csrc/cpu/moe_block.cpp says why; cb_kernels/moe_block.h what it computes).

    y = moe_block(x, shared_gate_up, shared_down, shared_gate=gate, router=router, top_k=2,
                  experts=experts)       # Qwen3-Next's sparse MoE block (Qwen2-MoE's too)
    y = moe_block(x, gate_up, down)      # Qwen3NextMLP: down(silu(gate(x)) * up(x))
    y = moe_block(x, router=router, top_k=8, experts=experts)    # Qwen3-MoE: no shared expert

x [num_tokens, hidden]; the linears are ops.PackedLinear of x's dtype (shared_gate_up [2 * inter,
hidden]: gate rows then up rows, shared_down [hidden, inter], shared_gate [1, hidden], router
[num_experts, hidden]), experts an ops.PackedExperts. With a router: y = moe_experts(x,
*moe_route(router(x), top_k)) + sigmoid(shared_gate(x)) * shared_expert(x), each op rounded to
the dtype where torch rounds it (ops/reference.py `ref_moe_block`); the stages are the separate
ops' own kernels, so y has their bits. The sigmoid is torch's scalar formula (libm's expf):
torch's own sigmoid uses it on fewer than two SIMD vectors of rows and a vectorised exp past
that, so on larger fp32 inputs the two may differ in the gate's last bit (`torch_scalar_rows`).
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import sync_threads
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.moe import PackedExperts

DTYPES = (torch.float32, torch.bfloat16)


def torch_scalar_rows(dtype: torch.dtype) -> int:
    """Rows of a contiguous [rows, 1] tensor below which torch's CPU sigmoid runs its scalar
    loop (libm's expf, this op's formula) on every row: two of its SIMD vectors of `dtype`
    (Vectorized<float> is 16 lanes under AVX-512, 8 otherwise; bf16 twice that)."""
    lanes = 16 if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16") else 8
    return 2 * lanes * (2 if dtype == torch.bfloat16 else 1)


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _lin(lin: Optional[PackedLinear]) -> tuple:
    """(packed weight, bias) addresses of a PackedLinear, 0 for none."""
    return (0, 0) if lin is None else (lin.packed.data_ptr(), _ptr(lin.bias))


def moe_block_unchecked(x: torch.Tensor, shared_gate_up: Optional[PackedLinear],
                        shared_down: Optional[PackedLinear], shared_gate: Optional[PackedLinear],
                        router: Optional[PackedLinear], top_k: int, renormalize: bool,
                        experts: Optional[PackedExperts], isa: str = "auto",
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`moe_block` without the checks, for callers that own them (runner/hybrid_layers.py):
    x [num_tokens, hidden] with unit column stride. `out`: a contiguous [num_tokens, hidden]
    tensor of x's dtype to write (else a new one)."""
    n, hidden = x.shape
    y = torch.empty(n, hidden, dtype=x.dtype) if out is None else out
    inter = shared_down.k if shared_down is not None else 0
    if experts is not None:
        e = (experts.gate_up, experts.down, experts.num_experts, experts.gate_up_stride,
             experts.down_stride, experts.inter)
    else:
        e = (None, None, 0, 0, 0, 0)
    sync_threads()
    _C.moe_block(
        x.dtype == torch.bfloat16,
        (x.data_ptr(), y.data_ptr(), *_lin(shared_gate_up), *_lin(shared_down),
         *_lin(shared_gate), *_lin(router), _ptr(e[0]), _ptr(e[1])),
        (n, hidden, x.stride(0) if n > 1 else hidden, hidden, inter, e[2], top_k, e[3], e[4], e[5]),
        bool(renormalize), isa)
    return y


def moe_block(x: torch.Tensor, shared_gate_up: Optional[PackedLinear] = None,
              shared_down: Optional[PackedLinear] = None, *,
              shared_gate: Optional[PackedLinear] = None, router: Optional[PackedLinear] = None,
              top_k: Optional[int] = None, renormalize: bool = True,
              experts: Optional[PackedExperts] = None, isa: str = "auto") -> torch.Tensor:
    """An MoE block or a dense gated MLP in one call.

    Parameters
    ----------
    x : float32 or bfloat16 CPU ``[num_tokens, hidden]``, rows any stride, columns packed.
    shared_gate_up, shared_down : the shared expert (or the whole MLP without a router):
        ops.PackedLinear ``[2 * inter, hidden]`` (gate rows, then up rows) and
        ``[hidden, inter]``; both or neither.
    shared_gate : ops.PackedLinear ``[1, hidden]``: the shared expert's output is scaled by
        sigmoid of it; needs a router and a shared expert. None: added as is.
    router : ops.PackedLinear ``[num_experts, hidden]`` (the top-k softmax router's logits);
        needs `experts` and `top_k`.
    top_k, renormalize : as ``moe_route``.
    experts : ops.PackedExperts of ``num_experts`` experts of width ``hidden``.
    isa : caps every kernel's body ("auto" or one of ``_C.cpu_isas()``, for tests).

    Returns a new ``[num_tokens, hidden]`` tensor of x's dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [num_tokens, hidden] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type != "cpu" or x.dtype not in DTYPES:
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    if x.shape[1] == 0 or x.stride(1) != 1:
        raise ValueError(f"x must have hidden >= 1 and unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    hidden = x.shape[1]
    for name, lin in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down),
                      ("shared_gate", shared_gate), ("router", router)):
        if lin is None:
            continue
        if not isinstance(lin, PackedLinear):
            raise TypeError(f"{name} must be an ops.PackedLinear, got {type(lin).__name__}")
        if lin.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {lin.dtype}")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down come together (both or neither)")
    if shared_gate_up is not None:
        if shared_gate_up.k != hidden or shared_gate_up.n % 2:
            raise ValueError(f"shared_gate_up must be [2 * inter, {hidden}], got "
                             f"[{shared_gate_up.n}, {shared_gate_up.k}]")
        if (shared_down.n, shared_down.k) != (hidden, shared_gate_up.n // 2):
            raise ValueError(f"shared_down must be [{hidden}, {shared_gate_up.n // 2}] (hidden, "
                             f"shared_gate_up's inter), got [{shared_down.n}, {shared_down.k}]")
    if shared_gate is not None:
        if shared_gate_up is None or router is None:
            raise ValueError("shared_gate needs a shared expert and a router")
        if (shared_gate.n, shared_gate.k) != (1, hidden):
            raise ValueError(f"shared_gate must be [1, {hidden}], got "
                             f"[{shared_gate.n}, {shared_gate.k}]")
    if router is None:
        if shared_gate_up is None:
            raise ValueError("moe_block needs a router (with experts) or a shared expert")
        if experts is not None or top_k is not None:
            raise ValueError("experts and top_k need a router")
        return moe_block_unchecked(x, shared_gate_up, shared_down, None, None, 0, renormalize,
                                   None, isa)
    if not isinstance(experts, PackedExperts):
        raise TypeError(f"experts must be an ops.PackedExperts with a router, got "
                        f"{type(experts).__name__}")
    if experts.dtype != x.dtype or experts.hidden != hidden:
        raise ValueError(f"experts must be {x.dtype} of hidden {hidden}, got {experts.dtype} of "
                         f"hidden {experts.hidden}")
    if (router.n, router.k) != (experts.num_experts, hidden):
        raise ValueError(f"router must be [{experts.num_experts}, {hidden}] (num_experts, "
                         f"hidden), got [{router.n}, {router.k}]")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or \
            not 0 < top_k <= experts.num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={experts.num_experts}], got "
                         f"{top_k!r}")
    return moe_block_unchecked(x, shared_gate_up, shared_down, shared_gate, router, top_k,
                               bool(renormalize), experts, isa)


def _packed(packed: Optional[torch.Tensor], n: int, k: int, dtype, name: str):
    """A bias-free PackedLinear over `packed` (the registered op's arguments), checked."""
    if packed is None:
        return None
    bf16 = dtype == torch.bfloat16
    elems = _C.linear_bf16_packed_elems(n, k) if bf16 else _C.linear_packed_floats(n, k)
    if not isinstance(packed, torch.Tensor) or packed.dtype != dtype or \
            packed.device.type != "cpu" or packed.numel() != elems or not packed.is_contiguous():
        raise ValueError(f"{name} must be the contiguous {dtype} packing of an [{n}, {k}] weight "
                         f"({elems} elements)")
    lin = PackedLinear.__new__(PackedLinear)
    lin.dtype, lin.n, lin.k, lin.packed, lin.bias = dtype, n, k, packed, None
    return lin


# The functional op over the packed tensors (PackedLinear.packed, bias-free; PackedExperts'
# gate_up / down), so torch.compile can trace the block.
@torch.library.custom_op("cb_kernels::moe_block", mutates_args=())
def _moe_block_op(x: torch.Tensor, shared_gate_up: Optional[torch.Tensor],
                  shared_down: Optional[torch.Tensor], shared_gate: Optional[torch.Tensor],
                  router: Optional[torch.Tensor], experts_gate_up: Optional[torch.Tensor],
                  experts_down: Optional[torch.Tensor], shared_inter: int, num_experts: int,
                  experts_inter: int, top_k: int, renormalize: bool) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError("x must be a [num_tokens, hidden] float32 or bfloat16 tensor")
    hidden, dt = x.shape[1], x.dtype
    experts = None
    if router is not None:
        if experts_gate_up is None or experts_down is None:
            raise ValueError("a router needs experts_gate_up and experts_down")
        experts = PackedExperts.from_packed(experts_gate_up, experts_down, num_experts, hidden,
                                            experts_inter)
    return moe_block(x, _packed(shared_gate_up, 2 * shared_inter, hidden, dt, "shared_gate_up"),
                     _packed(shared_down, hidden, shared_inter, dt, "shared_down"),
                     shared_gate=_packed(shared_gate, 1, hidden, dt, "shared_gate"),
                     router=_packed(router, num_experts, hidden, dt, "router"),
                     top_k=top_k if router is not None else None, renormalize=renormalize,
                     experts=experts)


@_moe_block_op.register_fake
def _(x, shared_gate_up, shared_down, shared_gate, router, experts_gate_up, experts_down,
      shared_inter, num_experts, experts_inter, top_k, renormalize):
    return x.new_empty(x.shape)
