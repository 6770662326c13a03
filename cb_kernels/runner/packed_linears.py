"""A CPU model's nn.Linear layers (fp32 or bf16) through weights packed once, for engine steps.

Why: torch's F.linear goes to MKL, which takes a slow path on the AMD bench machine, and linears
are most of a step on small models (78% of a SmolLM2-135M decode step at 16 rows, profiled).
Two GEMMs on packed weights ("auto" takes the first this CPU runs):
- "cbk": our kernel, ops.PackedLinear (csrc/cpu/linear.cpp; "auto" takes it with AVX-512, where
  it beats oneDNN; its AVX2 body is correct but slower than oneDNN). Streaming
  SmolLM2-135M's linears at 16 rows, 2 threads: 1.2x oneDNN's packed weights; 512 rows
  0.93-1.06x. Each output is one FMA chain over k, so a row's result depends on nothing else in
  the batch, the thread count or the ISA.
- "onednn": `torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`. Against F.linear
  at 16 rows: 1.2-1.45x on one thread, 2-3.3x on two. Its rows were also checked independent of
  the batch (1..700 rows, AVX-512 and AVX512-BF16 kernels); its bf16 AMX kernels are not: on an
  AMX Xeon a prefill over 32 rows changed a prompt's bf16 logits (issue #28).
So batch composition cannot change a sequence's tokens, except in bf16 where oneDNN runs on AMX
tiles (GEMM = "cbk" keeps the invariance there, at oneDNN's AMX speed lost). `GEMM` (module attribute:
"auto", "cbk", "onednn" or "torch") picks one for groups packed after it is set (benchmarks, tests).

bf16 weights: "cbk" (ops.PackedLinear's bf16 kernel, csrc/cpu/linear_bf16.cpp: vdpbf16ps,
fp32 sums, each output's adds in k order whatever the batch) where the CPU has AVX512-BF16 but
no AMX (2-core Zen 4, SmolLM2's linears, quiet: 16 rows 9.5 ms against oneDNN's 10.8 ms a step
on 2 threads, 17.1 against 18.1 on one; equal at 64 and 256 rows; both 1.8-2x our fp32 kernel);
else "onednn" (its bf16 matmul: AMX tiles on Sapphire Rapids and later, fp32 accumulation, bf16
out) wherever oneDNN runs bf16 natively (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`), else
"torch": F.linear on the concatenated bf16 weight (also what GEMM = "torch" forces, for tests).
oneDNN's bf16 rows were checked independent of the batch (1..700 rows,
brg_matmul:avx512_core_bf16); tests/runner assert it on every path wherever they run. fp16
weights are not packed (oneDNN's fp16 needs AVX512-FP16 / AMX-FP16, which no machine here has to
test it): an fp16 model keeps transformers' forward, logged.

How: for the duration of one step (`with packed:`) every plain `torch.nn.Linear` of the model gets
an instance `forward` that calls the packed weight; leaving restores the module exactly (the
user's model.generate keeps MKL), in reverse order, so nested entries unwind correctly. A linear
that has an instance `forward` of someone else's (a monkeypatch, an accelerate hook) keeps it:
that forward may not compute a plain linear. Installing is not thread-safe: the runner holds
one lock per model around it (runner/attention.py, `model_lock`). Sibling projections that read the
same input (q/k/v of an attention layer, gate/up of an MLP) share one packed weight: the first
call computes all of them and the siblings return their slices when called with the same input
tensor object, else compute their own. Weights are packed when built and repacked when a weight
tensor is replaced or changed in place (data_ptr and version checked on entry). Writes that
bypass the version counter are not seen: through `.data` (`w.data.copy_(...)`,
`w.data += delta`) or to inference tensors; after such a write call `engine.weights_updated()`
(or `refresh(force=True)` on this object), or the steps keep the old weights.
Assigning `w.data = new` is seen: a group holds the storages it packed from, so the new one
cannot reuse their address.

MoE experts modules and top-k routers that map onto our ops (runner/moe_layers.py) are packed,
installed for a step and refreshed the same way, beside the linears.

Cost: one packed copy of every linear weight (the model's own weights stay untouched). `build`
skips packing (returns None) when that copy would take more than a quarter of the host memory
the caller says is available; `EngineConfig(pack_weights=...)` forces either way.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.nn.modules import module as nn_module

from cb_kernels.ops.linear import PackedLinear
from cb_kernels.runner import moe_layers
from cb_kernels.runner.tensor_parallel import is_tp_hook

logger = logging.getLogger("cb_kernels.engine")

SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_PACK_ROWS_HINT = 32


GEMM = "auto"
GEMMS = ("auto", "cbk", "onednn", "torch")
DTYPES = (torch.float32, torch.bfloat16)


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16_native() -> bool:
    """oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX; AVX-512 emulates)."""
    return _onednn_ok() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_path() -> str:
    """Which bf16 linear path runs here, for `cb-kernels info` and the logs."""
    if gemm(torch.bfloat16) == "cbk":
        return ("ops.PackedLinear's bf16 kernel (AVX512-BF16 vdpbf16ps)"
                if PackedLinear.fast(torch.bfloat16) else "ops.PackedLinear's bf16 kernel (portable)")
    if gemm(torch.bfloat16) == "torch":
        return "F.linear on the concatenated weights (portable: oneDNN has no native bf16 here)"
    if torch.cpu._is_amx_tile_supported():
        unit = "AMX tiles"
    elif torch.cpu._is_avx512_bf16_supported():
        unit = "AVX512-BF16 vdpbf16ps"
    else:
        unit = "AVX-512, bf16 converted to fp32"
    return f"oneDNN bf16 matmul on packed weights ({unit})"


def gemm(dtype: torch.dtype = torch.float32) -> Optional[str]:
    """The GEMM new groups of `dtype` weights use: "cbk", "onednn", "torch", or None (none runs
    here: fp32 without oneDNN, or a dtype not packed)."""
    if GEMM not in GEMMS:
        raise ValueError(f"packed_linears.GEMM must be one of {GEMMS}, got {GEMM!r}")
    if dtype == torch.bfloat16:
        # With AMX, oneDNN's tiles do 16x the bf16 products of a vdpbf16ps per instruction:
        # ours is taken where the CPU has AVX512-BF16 and no AMX (measured on Zen 4 only).
        ours = PackedLinear.fast(torch.bfloat16) and not torch.cpu._is_amx_tile_supported()
        if GEMM == "cbk" or (GEMM == "auto" and ours):
            return "cbk"      # forced: its portable body runs on any CPU
        if GEMM == "onednn":
            return "onednn" if _onednn_ok() else "torch"
        return "onednn" if GEMM == "auto" and onednn_bf16_native() else "torch"
    if dtype != torch.float32:
        return None
    if GEMM == "cbk" or (GEMM == "auto" and PackedLinear.fast()):
        return "cbk"          # forced: its portable body runs on any CPU
    if GEMM in ("auto", "onednn") and _onednn_ok():
        return "onednn"
    if GEMM == "torch":
        return "torch"
    return None


def supported(dtype: torch.dtype = torch.float32) -> bool:
    return gemm(dtype) is not None


def model_dtype(model) -> Optional[torch.dtype]:
    """The dtype of the model's first floating-point parameter (None without one)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _plain_linear(m, dtype: torch.dtype = torch.float32) -> bool:
    """A torch.nn.Linear (not a subclass with its own forward), CPU, weight and bias of `dtype`,
    no accelerate hook, no instance forward."""
    return type(m) is torch.nn.Linear and m.weight.device.type == "cpu" \
        and m.weight.dtype == dtype and not hasattr(m, "_hf_hook") \
        and "forward" not in m.__dict__ and (m.bias is None or m.bias.dtype == dtype)


def _identity(t: Optional[torch.Tensor]):
    """What changes when a parameter is replaced or written in place (inference tensors have no
    version counter: their in-place writes cannot be seen)."""
    if t is None:
        return None
    return (t.data_ptr(), 0 if t.is_inference() else t._version)


class _Group:
    """One packed weight serving one or more linears that read the same input.

    members: nn.Linear modules, their outputs concatenated in this order."""

    def __init__(self, members: list):
        self.members = members
        self.dtype = members[0].weight.dtype
        self.splits = [m.out_features for m in members]
        self.key = None
        self.weight: Optional[torch.Tensor] = None   # oneDNN's packed weight
        self.bias: Optional[torch.Tensor] = None
        self.lin: Optional[PackedLinear] = None       # or ours
        self.last_input = None
        self.last_outputs: list = []
        self.forwards = [self._forward_of(i) for i in range(len(members))]
        self.num_packs = 0          # packed copies made (the engine's warm-up test counts them)

    def current_key(self) -> tuple:
        # _parameters, not m.weight: nn.Module.__getattr__ made this check 5x slower (every
        # step checks every group); a parameter name can only hold a Parameter or None.
        return tuple((_identity(m._parameters["weight"]), _identity(m._parameters.get("bias")))
                     for m in self.members)

    def refresh(self, force: bool = False) -> None:
        key = self.current_key()
        if key == self.key and not force:
            return
        # Holding the storages packed from keeps their addresses from being reused by a later
        # `.data = ...` (whose version counter does not move): a new address means a repack.
        self.sources = [t.untyped_storage() for m in self.members for t in (m.weight, m.bias)
                        if t is not None]
        w = torch.cat([m.weight.detach() for m in self.members]) if len(self.members) > 1 \
            else self.members[0].weight.detach()
        biases = [m.bias for m in self.members]
        if all(b is None for b in biases):
            self.bias = None
        else:
            self.bias = torch.cat([b.detach() if b is not None else
                                   torch.zeros(m.out_features, dtype=self.dtype)
                                   for m, b in zip(self.members, biases)])
        self.gemm = gemm(self.dtype)
        self.lin = None
        if self.gemm == "cbk":
            self.lin, self.weight = PackedLinear(w, self.bias), None
        elif self.gemm == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT)
        else:       # "torch": the weights concatenated (siblings in one call), F.linear
            self.weight = w.contiguous() if len(self.members) > 1 else w
        self.key = key
        self.num_packs += 1

    def run(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [..., in_features] -> [..., sum of out_features]; `out` (contiguous [rows, sum of
        out_features]) is written and returned where our GEMM runs, else ignored."""
        if self.lin is not None:
            return self.lin.run_unchecked(x, out=out)
        if self.gemm == "torch":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _forward_of(self, index: int):
        if len(self.members) == 1:
            return self.run

        def forward(x: torch.Tensor) -> torch.Tensor:
            if index == 0 or self.last_input is not x:
                self.last_outputs = list(self.run(x).split(self.splits, dim=-1))
                self.last_input = x
            out = self.last_outputs[index]
            if index == len(self.members) - 1:
                self.last_input, self.last_outputs = None, []
            return out
        forward.cbk_packed = True
        return forward


def is_packed_forward(fn) -> bool:
    """Whether `fn` (a module's instance `forward`) is one that PackedLinears installs."""
    return isinstance(getattr(fn, "__self__", None), _Group) or \
        getattr(fn, "cbk_packed", None) is True


def has_hooks(modules: list) -> bool:
    """A forward hook (the tensor-parallel collectives of runner/tensor_parallel/ aside: the
    paths that skip module calls run them themselves), or an instance `forward` not installed by
    PackedLinears (another engine's step may be running on the model in another thread), on any
    of `modules`. Reads each
    module's __dict__: 37 us a step for the 397 modules of a 30-layer Llama (SmolLM2-135M's
    layout) on the dev box."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    try:
        for m in modules:
            d = m.__dict__
            hooks, pre = d["_forward_hooks"], d["_forward_pre_hooks"]
            if (hooks and not all(map(is_tp_hook, hooks.values()))) or \
                    (pre and not all(map(is_tp_hook, pre.values()))):
                return True
            forward = d.get("forward")
            if forward is not None and not is_packed_forward(forward):
                return True
    except KeyError:            # a module without hook dicts: not one this path knows
        return True
    return False


class PackedLinears:
    """Context manager: inside it, the model's plain linears run on packed weights."""

    def __init__(self, groups: list, experts: tuple = ()):
        self.groups = groups
        # moe_layers' groups: experts modules on ops.moe_experts, routers on a packed weight
        self.experts = list(experts)
        # Every member's parameter dict, for refresh()'s one-pass check, and what it last saw.
        self._param_dicts = [m._parameters for g in groups for m in g.members]
        self._key = None
        self._installed: list = []     # (module, instance forward it had or None)
        self._depth = 0                # entries not yet left (re-entering installs nothing)

    @classmethod
    def build(cls, model, pack_weights="auto",
              available_bytes: Optional[int] = None) -> Optional["PackedLinears"]:
        """None when nothing qualifies or `pack_weights` is False, or ("auto") when the packed
        copy would take more than a quarter of `available_bytes` (host memory; None = no
        limit). The linears packed are those of the model's dtype (its first parameter's),
        fp32 or bf16. The model's MoE experts modules that map onto ops.moe_experts are packed
        too (runner/moe_layers.py)."""
        dtype = model_dtype(model)
        if pack_weights is False or dtype not in DTYPES or not supported(dtype):
            if pack_weights is not False and dtype not in DTYPES and dtype is not None:
                logger.info("pack_weights: off (%s weights are not packed on CPU; the model runs "
                            "transformers' forward)", dtype)
            return None
        groups, grouped = [], set()
        for parent in model.modules():
            for names in SIBLING_GROUPS:
                members = [getattr(parent, n, None) for n in names]
                # Distinct modules only: one module twice (tied k/v) would get two forwards.
                if all(_plain_linear(m, dtype) and id(m) not in grouped for m in members) and \
                        len({id(m) for m in members}) == len(members) and \
                        len({m.in_features for m in members}) == 1:
                    groups.append(_Group(members))
                    grouped.update(id(m) for m in members)
        for m in model.modules():
            if _plain_linear(m, dtype) and id(m) not in grouped:
                groups.append(_Group([m]))
        experts = moe_layers.find(model, dtype)
        if not groups and not experts:
            return None
        nbytes = sum(m.weight.numel() * m.weight.element_size() for g in groups for m in g.members)
        nbytes += sum(g.source_bytes() for g in experts)
        if pack_weights == "auto" and available_bytes is not None:
            available = available_bytes
            if nbytes > available // 4:
                logger.info("pack_weights: not packing %.2f GiB of linear weights (available "
                            "host memory %.2f GiB); pass EngineConfig(pack_weights=True) to force",
                            nbytes / 2**30, available / 2**30)
                return None
        logger.info("pack_weights: %d %s linears in %d packed weights (%.1f MiB extra, GEMM %s)",
                    sum(len(g.members) for g in groups), str(dtype).replace("torch.", ""),
                    len(groups), nbytes / 2**20, gemm(dtype))
        packed = cls(groups, experts)
        # Now, not at the first step: the engine sizes its KV pool from the memory left after
        # this copy, and a second Engine's "auto" check sees the first one's copy.
        packed.refresh()
        return packed

    def group_of(self, module) -> Optional[_Group]:
        """The group whose first member is `module` (a fused group's siblings return None)."""
        if not hasattr(self, "_first"):
            self._first = {id(g.members[0]): g for g in self.groups}
        return self._first.get(id(module))

    def runner_for(self, module):
        """A callable rows -> module(rows) that takes the packed weight (no context needed) unless
        `module` has a hook or someone else's instance forward, which then run as they are."""
        group = self.group_of(module)
        if group is None or len(group.members) != 1:
            return module

        def run(rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
            return module(rows) if has_hooks([module]) else group.run(rows, out)
        run.takes_out = True       # lm_head.LogitsHead passes its logits workspace
        return run

    def refresh(self, force: bool = False) -> None:
        """Repack the weights that were replaced or changed in place since the last step (all of
        them with `force`: after writes the version counter misses, see the module docstring)."""
        # One pass over every member's parameters first (each step does this: 0.06 ms for
        # SmolLM2's 210 linears on the loaded bench host, against 0.31 ms walking the groups).
        key = [(_identity(d["weight"]), _identity(d.get("bias"))) for d in self._param_dicts]
        key += [g.current_key() for g in self.experts]
        if key == self._key and not force:
            return
        for g in self.groups + self.experts:
            g.refresh(force)
        self._key = key

    def release(self) -> int:
        """Drop every packed copy (Engine.sleep(level=2)); returns the bytes they held (an
        F.linear group of one linear reads the model's own weight: 0). The next refresh()
        packs again."""
        freed = 0
        for g in self.groups:
            own = [g.lin.packed, g.lin.bias] if g.lin is not None else [g.weight, g.bias]
            if g.lin is None and g.gemm == "torch" and len(g.members) == 1:
                own = [g.bias]      # the model's own weight, not a copy
            freed += sum(t.numel() * t.element_size() for t in own if t is not None)
            g.lin = g.weight = g.bias = g.key = None
            g.sources = []
        freed += sum(g.release() for g in self.experts)
        self._key = None
        return freed

    def __enter__(self) -> "PackedLinears":
        self._depth += 1
        if self._depth > 1:
            return self
        try:
            self.refresh()
            for g in self.groups + self.experts:
                for i, m in enumerate(g.members):
                    previous = m.__dict__.get("forward")
                    if previous is not None and not is_packed_forward(previous):
                        continue        # someone else's forward: it runs, not the packed one
                    self._installed.append((m, previous))
                    m.forward = g.forwards[i]
        except BaseException:
            self._depth = 0
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _restore(self) -> None:
        for m, previous in reversed(self._installed):
            if previous is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = previous
        self._installed.clear()
        for g in self.groups:
            g.last_input, g.last_outputs = None, []
