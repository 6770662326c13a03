"""A model's MoE experts modules on ops.moe_experts (one call per layer per step, weights packed
once), for engine steps; packed_linears.PackedLinears holds and installs them with the linears.

Which modules: transformers routes the experts of Qwen3-Next, Qwen3.5-MoE, Qwen3-MoE, Mixtral,
Jamba, OLMoE, ... through `use_experts_implementation` (transformers.integrations.moe, in 5.17
and 5.24 alike): a module whose forward is `(hidden_states, top_k_index, top_k_weights)` over
`gate_up_proj [E, 2 * inter, hidden]` and `down_proj [E, hidden, inter]`, with flags saying how
the weights are laid out. One maps onto the op when it is that decorator's module with the
default gate (`_default_apply_gate`: act(gate) * up over concatenated [gate; up] rows), a SiLU
activation, no bias, no transposed weights, no post-expert norm, no expert parallelism, weights
of the model's dtype on the CPU, and no hook or instance forward of someone else. Everything
else keeps transformers' code (the reason logged once at Engine()). The op's SIMD body must run
here (fp32: AVX-512; bf16: AVX512-BF16), else the experts keep transformers' code too (`MOE`
"on" forces the op, portable body included: tests).

Why not register the op in transformers' `ExpertsInterface`: that dispatches on
`config._experts_implementation`, a setting of the user's model that `model.generate` reads too;
an instance `forward` installed for the duration of a step (as the packed linears do) leaves the
user's model exactly as it was.

Following the weights: a group packs when built and again when `gate_up_proj` or `down_proj` is
replaced (load_state_dict(assign=True), `.data = ...`) or written in place (version counter);
PackedLinears.refresh() checks them with the linears every step.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

import torch

from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.moe import PackedExperts, release_workspaces

logger = logging.getLogger("cb_kernels.engine")

MOE = "auto"
MOES = ("auto", "on", "off")
# False: the engine's own forwards run an MoE block's (or a dense MLP's) router, experts and
# shared expert as separate calls instead of one ops.moe_block (benchmarks and tests compare).
BLOCK = True


def _identity(t: Optional[torch.Tensor]):
    if t is None:
        return None
    return (t.data_ptr(), 0 if t.is_inference() else t._version)


def _default_gate():
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    return _default_apply_gate


def why_not(module, dtype: torch.dtype) -> Optional[str]:
    """None when `module` is an experts module ops.moe_experts computes exactly as its own
    forward, else the reason (for the log). Not an experts module at all: "not experts"."""
    params = module.__dict__.get("_parameters", {})
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or not hasattr(module, "has_gate"):
        return "not experts"
    gate = _default_gate()
    if gate is None or getattr(type(module), "_apply_gate", None) is not gate:
        return "its own gating function"
    if not module.has_gate or module.has_bias or module.is_transposed or \
            not getattr(module, "is_concatenated", True) or \
            getattr(module, "has_post_expert_norm", False) or \
            getattr(module, "_is_expert_parallel", False):
        return "a layout the op does not take (no gate, bias, transposed or interleaved " \
               "weights, a post-expert norm, or expert parallelism)"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return f"activation {type(act).__name__} (the op computes SiLU)"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or \
            tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        return f"weight shapes {tuple(gate_up.shape)} / {tuple(down.shape)}"
    if getattr(module, "num_experts", gate_up.shape[0]) != gate_up.shape[0]:
        return "num_experts differs from the weights' first dimension"
    if gate_up.device.type != "cpu" or gate_up.dtype != dtype or down.dtype != dtype:
        return f"weights {gate_up.dtype} on {gate_up.device} (the op takes the model's {dtype} on CPU)"
    if "forward" in module.__dict__ or hasattr(module, "_hf_hook") or module._forward_hooks or \
            module._forward_pre_hooks:
        return "a hook or an instance forward"
    return None


def enabled(dtype: torch.dtype) -> bool:
    if MOE not in MOES:
        raise ValueError(f"moe_layers.MOE must be one of {MOES}, got {MOE!r}")
    return MOE == "on" or (MOE == "auto" and PackedExperts.fast(dtype))


class ExpertsGroup:
    """One experts module on its packed weights; `forwards[0]` is its instance forward during a
    step (PackedLinears installs it)."""

    def __init__(self, module):
        self.members = [module]
        self.experts: Optional[PackedExperts] = None
        self.key = None
        self.sources: list = []
        self.num_packs = 0
        self.last_input, self.last_outputs = None, []   # PackedLinears' group interface

        def forward(hidden_states, top_k_index, top_k_weights):
            return self.run(hidden_states, top_k_index, top_k_weights)
        forward.cbk_packed = True
        self.forwards = [forward]

    def current_key(self) -> tuple:
        d = self.members[0]._parameters
        return (_identity(d["gate_up_proj"]), _identity(d["down_proj"]))

    def refresh(self, force: bool = False) -> None:
        key = self.current_key()
        if key == self.key and not force:
            return
        m = self.members[0]
        # Held so a later `.data = ...` cannot reuse the address (see packed_linears).
        self.sources = [m.gate_up_proj.untyped_storage(), m.down_proj.untyped_storage()]
        self.experts = PackedExperts(m.gate_up_proj, m.down_proj)
        self.key = key
        self.num_packs += 1

    def release(self) -> int:
        """Drop the packed experts and the op's work buffers (every group's: the first group
        released frees them); returns the bytes freed."""
        freed = self.experts.nbytes if self.experts is not None else 0
        self.experts, self.key, self.sources = None, None, []
        return freed + release_workspaces()

    def source_bytes(self) -> int:
        m = self.members[0]
        return sum(t.numel() * t.element_size() for t in (m.gate_up_proj, m.down_proj))

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts forward: hidden_states [num_tokens, hidden], top_k_index
        [num_tokens, top_k], top_k_weights [num_tokens, top_k] (the router's dtype). Inputs the
        op does not take (another dtype, as under autocast; not 2-D; off the CPU) go to the
        module's own forward."""
        experts = self.experts
        if hidden_states.dtype != experts.dtype or hidden_states.dim() != 2 or \
                hidden_states.device.type != "cpu" or top_k_index.dim() != 2:
            m = self.members[0]
            return type(m).forward(m, hidden_states, top_k_index, top_k_weights)
        x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
        ids = top_k_index if top_k_index.dtype == torch.int64 else top_k_index.long()
        return experts.run_unchecked(x, ids.contiguous(), top_k_weights.float().contiguous())


@functools.lru_cache(maxsize=1)
def _topk_router_source() -> Optional[str]:
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter
        return inspect.getsource(Qwen3NextTopKRouter.forward)
    except (ImportError, OSError, TypeError):
        return None


def router_maps(module, dtype: torch.dtype) -> bool:
    """`module` is a top-k softmax router whose forward is transformers' Qwen3-Next one, source
    for source (Qwen3-Next, Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo share it: the logits
    F.linear(x, weight), an fp32 softmax, top-k, optional renormalisation, the dtype cast), with
    a weight of `dtype` on the CPU and no hook or instance forward."""
    ref = _topk_router_source()
    weight = module.__dict__.get("_parameters", {}).get("weight")
    if ref is None or weight is None or weight.dim() != 2 or weight.dtype != dtype or \
            weight.device.type != "cpu" or not hasattr(module, "top_k"):
        return False
    try:
        if inspect.getsource(type(module).forward) != ref:
            return False
    except (OSError, TypeError):
        return False
    return "forward" not in module.__dict__ and not hasattr(module, "_hf_hook") and \
        not module._forward_hooks and not module._forward_pre_hooks


class RouterGroup:
    """A top-k router (router_maps) with its logits on ops.PackedLinear: transformers' F.linear
    goes to MKL, whose bf16 path on the AMD bench machine took ~94 us a call for 16 x 256 x 8;
    the softmax and top-k stay torch's."""

    def __init__(self, module):
        self.members = [module]
        self.lin: Optional[PackedLinear] = None
        self.key = None
        self.sources: list = []
        self.num_packs = 0
        self.last_input, self.last_outputs = None, []

        def forward(hidden_states):
            return self.run(hidden_states)
        forward.cbk_packed = True
        self.forwards = [forward]

    def current_key(self) -> tuple:
        return (_identity(self.members[0]._parameters["weight"]),)

    def refresh(self, force: bool = False) -> None:
        key = self.current_key()
        if key == self.key and not force:
            return
        weight = self.members[0].weight
        self.sources = [weight.untyped_storage()]
        self.lin = PackedLinear(weight)
        self.key = key
        self.num_packs += 1

    def release(self) -> int:
        freed = self.lin.packed.numel() * self.lin.packed.element_size() if self.lin else 0
        self.lin, self.key, self.sources = None, None, []
        return freed

    def source_bytes(self) -> int:
        w = self.members[0].weight
        return w.numel() * w.element_size()

    def run(self, hidden_states: torch.Tensor):
        """(router_logits, top-k weights in the logits' dtype, top-k expert ids), as the
        module's own forward."""
        m = self.members[0]
        if hidden_states.dtype != self.lin.dtype or hidden_states.device.type != "cpu":
            return type(m).forward(m, hidden_states)      # (autocast): the module's own code
        logits = self.lin.run_unchecked(hidden_states.reshape(-1, m.hidden_dim))
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, m.top_k, dim=-1)
        if m.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index


def find(model, dtype: torch.dtype) -> list:
    """ExpertsGroup of every experts module of `model` that maps onto ops.moe_experts, and
    RouterGroup of every router that maps (packed); logs which take the op and why the others
    do not."""
    groups, refused = [], {}
    routers = [RouterGroup(m) for m in model.modules()
               if enabled(dtype) and PackedLinear.fast(dtype) and router_maps(m, dtype)]
    if routers:
        logger.info("moe: %d %s routers' logits on ops.PackedLinear", len(routers),
                    type(routers[0].members[0]).__name__)
    for m in model.modules():
        reason = why_not(m, dtype)
        if reason == "not experts":
            continue
        if reason is None and not enabled(dtype):
            reason = f"the op's SIMD body does not run here ({PackedExperts.isa(dtype)})"
        if reason is None:
            groups.append(ExpertsGroup(m))
        else:
            refused.setdefault((type(m).__name__, reason), 0)
            refused[(type(m).__name__, reason)] += 1
    if groups:
        logger.info("moe: %d %s experts modules on ops.moe_experts (%s body)", len(groups),
                    type(groups[0].members[0]).__name__, PackedExperts.isa(dtype))
    for (name, reason), n in refused.items():
        logger.info("moe: %d %s experts modules keep transformers' code: %s", n, name, reason)
    return groups + routers
