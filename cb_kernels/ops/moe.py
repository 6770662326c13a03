"""The routed experts of an MoE layer in one call, on expert weights packed once
(csrc/cpu/moe_experts.cpp).

    experts = PackedExperts(gate_up_proj, down_proj)   # [E, 2 * inter, hidden], [E, hidden, inter]
    y = moe_experts(x, top_k_index, top_k_weights, experts)   # x [num_tokens, hidden]

For every (token, k) pair of the router's top-k: d = down_e(silu(gate_e(x)) * up_e(x)) with
e = top_k_index[token, k], and y[token] = sum over k of top_k_weights[token, k] * d: what
transformers' experts forward (`grouped_mm_experts_forward`, for experts classes under
`use_experts_implementation` with a concatenated, untransposed, bias-free silu gate) computes.
fp32 and bf16: in bf16 every step rounds to bf16 where transformers' does and the k sum is fp32,
rounded once (ops/reference.py `ref_moe_experts`). The GEMMs are ops.PackedLinear's (the same
packed layout and bits per expert); threads take (expert, row chunk) items, gated on the call's
work, so a small decode step runs on the calling thread. A token's result does not depend on the
other tokens, the thread count or the split.
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads

DTYPES = (torch.float32, torch.bfloat16)


class PackedExperts:
    """Packed copies of one MoE layer's expert weights: gate_up_proj [num_experts, 2 * inter,
    hidden] (each expert's inter gate rows, then its inter up rows) and down_proj [num_experts,
    hidden, inter], fp32 or bf16 CPU tensors of one dtype."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
        for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.device.type != "cpu" or t.dtype not in DTYPES:
                raise ValueError(f"{name} must be a 3-D fp32 or bf16 CPU tensor, got shape "
                                 f"{tuple(t.shape)}, {t.dtype} on {t.device}")
        if down_proj.dtype != gate_up_proj.dtype:
            raise ValueError(f"down_proj must have gate_up_proj's dtype {gate_up_proj.dtype}, got "
                             f"{down_proj.dtype}")
        num_experts, two_inter, hidden = gate_up_proj.shape
        if num_experts == 0 or hidden == 0 or two_inter == 0 or two_inter % 2:
            raise ValueError(f"gate_up_proj must be [num_experts, 2 * inter, hidden] with all sizes "
                             f"> 0, got shape {tuple(gate_up_proj.shape)}")
        inter = two_inter // 2
        if tuple(down_proj.shape) != (num_experts, hidden, inter):
            raise ValueError(f"down_proj must be [{num_experts}, {hidden}, {inter}] (num_experts, "
                             f"hidden, inter of gate_up_proj), got {tuple(down_proj.shape)}")
        self.dtype = gate_up_proj.dtype
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        bf16 = self.dtype == torch.bfloat16
        self.gate_up_stride = _C.moe_packed_elems(bf16, 2 * inter, hidden)
        self.down_stride = _C.moe_packed_elems(bf16, hidden, inter)
        self.gate_up = torch.empty(num_experts * self.gate_up_stride, dtype=self.dtype)
        self.down = torch.empty(num_experts * self.down_stride, dtype=self.dtype)
        pack = _C.linear_bf16_pack if bf16 else _C.linear_pack
        gate_up_proj, down_proj = gate_up_proj.detach(), down_proj.detach()
        for e in range(num_experts):
            w = gate_up_proj[e].contiguous()
            pack(w.data_ptr(), 2 * inter, hidden, hidden,
                 self.gate_up.data_ptr() + e * self.gate_up_stride * self.gate_up.element_size())
            w = down_proj[e].contiguous()
            pack(w.data_ptr(), hidden, inter, inter,
                 self.down.data_ptr() + e * self.down_stride * self.down.element_size())

    @classmethod
    def from_packed(cls, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int,
                    hidden: int, inter: int) -> "PackedExperts":
        """PackedExperts over tensors packed before (`experts.gate_up`, `experts.down`): the
        registered op's arguments. ValueError when they are not that packing's sizes."""
        bf16 = gate_up.dtype == torch.bfloat16
        gate_up_stride = _C.moe_packed_elems(bf16, 2 * inter, hidden)
        down_stride = _C.moe_packed_elems(bf16, hidden, inter)
        if gate_up.dtype not in DTYPES or down.dtype != gate_up.dtype or \
                gate_up.device.type != "cpu" or down.device.type != "cpu" or \
                gate_up.numel() != num_experts * gate_up_stride or \
                down.numel() != num_experts * down_stride or \
                not gate_up.is_contiguous() or not down.is_contiguous():
            raise ValueError(f"gate_up / down must be PackedExperts' contiguous packed CPU tensors "
                             f"of {num_experts} experts [{2 * inter}, {hidden}] / [{hidden}, "
                             f"{inter}]")
        experts = cls.__new__(cls)
        experts.dtype = gate_up.dtype
        experts.num_experts, experts.hidden, experts.inter = num_experts, hidden, inter
        experts.gate_up_stride, experts.down_stride = gate_up_stride, down_stride
        experts.gate_up, experts.down = gate_up, down
        return experts

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + \
            self.down.numel() * self.down.element_size()

    @staticmethod
    def isa(dtype: torch.dtype = torch.float32, cap: str = "auto") -> str:
        """The body that runs here for `dtype` (capped by `cap`): fp32 "avx512" or "portable",
        bf16 "avx512_bf16" or "portable"."""
        return _C.moe_experts_isa(dtype == torch.bfloat16, cap)

    @staticmethod
    def fast(dtype: torch.dtype = torch.float32) -> bool:
        """The SIMD body runs here (fp32: AVX-512; bf16: AVX512-BF16); the portable one is a
        reference the engine does not take."""
        return PackedExperts.isa(dtype) != "portable"

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, isa: str = "auto"):
        return moe_experts(hidden_states, top_k_index, top_k_weights, self, isa=isa)

    def run_unchecked(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, isa: str = "auto") -> torch.Tensor:
        """moe_experts without the argument checks, for callers that own them (the engine's
        MoE layers): hidden_states [num_tokens, hidden] with unit column stride, top_k_index
        contiguous int64, top_k_weights contiguous fp32. An expert id out of range still
        raises (RuntimeError from the kernel)."""
        num_tokens = hidden_states.shape[0]
        y = torch.empty(num_tokens, self.hidden, dtype=self.dtype)
        sync_threads()
        _C.moe_experts(self.dtype == torch.bfloat16, hidden_states.data_ptr(), num_tokens,
                       self.hidden, hidden_states.stride(0) if num_tokens > 1 else self.hidden,
                       top_k_index.data_ptr(), top_k_weights.data_ptr(), top_k_index.shape[1],
                       self.num_experts, self.inter, self.gate_up.data_ptr(), self.gate_up_stride,
                       self.down.data_ptr(), self.down_stride, y.data_ptr(), self.hidden, isa)
        return y


def workspace_bytes() -> int:
    """Bytes of the work buffers moe_experts keeps between calls, over every thread that ran it:
    the routing lists, the [num_tokens * top_k, hidden] fp32 contributions of the largest call
    so far, the GEMM scratch of each worker."""
    return _C.moe_workspace_bytes()


def release_workspaces() -> int:
    """Free those buffers (the next call allocates again); returns the bytes freed. Buffers of a
    call running at that moment stay."""
    return _C.moe_release_workspaces()


def moe_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, experts: PackedExperts, *,
                isa: str = "auto") -> torch.Tensor:
    """hidden_states: [num_tokens, hidden] (the experts' dtype, unit column stride);
    top_k_index: int64 [num_tokens, top_k], each in [0, num_experts); top_k_weights: float32
    [num_tokens, top_k] (a bf16 router's weights converted with .float(): exact). Returns a new
    [num_tokens, hidden] tensor. `isa` caps the body ("auto" or one of _C.cpu_isas())."""
    if not isinstance(experts, PackedExperts):
        raise TypeError(f"experts must be a PackedExperts, got {type(experts).__name__}")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or \
            hidden_states.shape[1] != experts.hidden:
        raise ValueError(f"hidden_states must be a [num_tokens, {experts.hidden}] tensor, got "
                         f"{_shape(hidden_states)}")
    if hidden_states.device.type != "cpu" or hidden_states.dtype != experts.dtype:
        raise ValueError(f"hidden_states must be {experts.dtype} on the CPU (the experts' dtype), "
                         f"got {hidden_states.dtype} on {hidden_states.device}")
    if hidden_states.stride(1) != 1:
        raise ValueError("hidden_states must have unit column stride (rows may be strided)")
    num_tokens = hidden_states.shape[0]
    for name, t, dtype in (("top_k_index", top_k_index, torch.int64),
                           ("top_k_weights", top_k_weights, torch.float32)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu":
            raise TypeError(f"{name} must be a {dtype} CPU tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] == 0 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{num_tokens}, top_k] tensor (top_k "
                             f">= 1), got {tuple(t.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights {tuple(top_k_weights.shape)} must match top_k_index "
                         f"{tuple(top_k_index.shape)}")
    if top_k_index.numel() and (int(top_k_index.min()) < 0 or
                                int(top_k_index.max()) >= experts.num_experts):
        raise ValueError(f"top_k_index must hold expert ids in [0, {experts.num_experts}), got "
                         f"{int(top_k_index.min())}..{int(top_k_index.max())}")
    return experts.run_unchecked(hidden_states, top_k_index, top_k_weights, isa)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


# The functional op over PackedExperts' tensors, so torch.compile can trace the experts.
@torch.library.custom_op("cb_kernels::moe_experts", mutates_args=())
def _moe_experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    num_experts: int, inter: int) -> torch.Tensor:
    experts = PackedExperts.from_packed(gate_up, down, num_experts, hidden_states.shape[-1], inter)
    return moe_experts(hidden_states, top_k_index, top_k_weights, experts)


@_moe_experts_op.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up, down, num_experts, inter):
    return hidden_states.new_empty(hidden_states.shape)


def moe_route(router_logits: torch.Tensor, top_k: int, *,
              renormalize: bool = True) -> tuple:
    """A top-k softmax router after its logits, as transformers' Qwen3NextTopKRouter (Qwen3-MoE,
    Qwen2-MoE, OLMoE, FlexOlmo share it) computes: softmax in fp32, the top_k largest (largest
    first, tied values in torch.topk's order: the same algorithm), divided by their sum when `renormalize`, rounded
    to the logits' dtype (csrc/cpu/moe_route.cpp says why one call).

    router_logits: float32 or bfloat16 CPU [num_tokens, num_experts], rows any stride, experts
    packed. Returns (top_k_weights float32 [num_tokens, top_k] holding the rounded values,
    top_k_index int64 [num_tokens, top_k]): what `moe_experts` takes."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.device.type != "cpu" or \
            router_logits.dtype not in DTYPES:
        raise TypeError("router_logits must be a float32 or bfloat16 CPU tensor, got "
                        f"{getattr(router_logits, 'dtype', type(router_logits).__name__)}")
    if router_logits.dim() != 2 or router_logits.shape[1] == 0 or \
            (router_logits.shape[1] > 1 and router_logits.stride(1) != 1):
        raise ValueError("router_logits must be [num_tokens, num_experts] with the experts "
                         f"packed, got shape {tuple(router_logits.shape)} strides "
                         f"{router_logits.stride()}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or \
            not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be an int in [1, num_experts={router_logits.shape[1]}], "
                         f"got {top_k!r}")
    return moe_route_unchecked(router_logits, top_k, bool(renormalize))


def moe_route_unchecked(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple:
    """`moe_route` without the checks (runner/hybrid_layers.py's MoE layers)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    _C.moe_route(router_logits.data_ptr(), num_tokens, num_experts,
                 router_logits.stride(0) if num_tokens > 1 else num_experts, top_k, renormalize,
                 DTYPE_CODES[router_logits.dtype], weights.data_ptr(), ids.data_ptr())
    return weights, ids


@torch.library.custom_op("cb_kernels::moe_route", mutates_args=())
def _moe_route_op(router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_route(router_logits, top_k, renormalize=renormalize)


@_moe_route_op.register_fake
def _(router_logits, top_k, renormalize):
    n = router_logits.shape[0]
    return (router_logits.new_empty((n, top_k), dtype=torch.float32),
            router_logits.new_empty((n, top_k), dtype=torch.int64))
