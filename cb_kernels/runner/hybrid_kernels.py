"""Stateful layers that run on cb_kernels' own kernels instead of their transformers code.

A gated delta-net layer (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) or a Mamba-2 mixer (Mamba2, Bamba,
Granite-MoE-hybrid, Nemotron-H) runs as one call per step for all its rows, decodes and prefills
mixed: its projections over the packed row once, then `ops.causal_conv1d` and
`ops.gated_delta_rule` / `ops.selective_scan` on the state slots in place (the rows' varlen
split from the step's plan, `VarlenRows`), then the layer's own norm and output projection.
Where the layer fits (`why_not_fused` ""), all of it between the projections is one
`ops.fused_hybrid` call (the split and the gates in C++ too), and runner/hybrid_layers.py runs
the whole layer around it as one call (`block`: the norms and packed linears inside); `FUSED`
off keeps the separate calls. Without this the slot wrappers (state_switch._Wrapped) run the
layer's own forward once per prefill row plus once for the decode batch, on gathered copies of
the slots.

`kernel_for(module, entry)` decides per module when a StateSwitch with a pool is built: a known
class on CPU, fp32 or bf16, SiLU conv, fp32 recurrent slots of the kernels' layout; then one
probe on random hidden states (a fresh prefill, a continued chunk and a decode on a 1-slot
scratch pool) whose output must match the module's own forward on the same tokens, within 1e-4
of the largest output (fp32) or 3e-2 (bf16). Anything else keeps transformers' code, and the
runner logs which path each class takes (`describe`).
"""
from __future__ import annotations

import functools
import logging
from itertools import accumulate
from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.ops.fused_hybrid import (gated_delta_net_block_unchecked,
                                        gated_delta_net_block_workspace_bytes,
                                        gated_delta_net_unchecked, mamba2_block_unchecked,
                                        mamba2_block_workspace_bytes, mamba2_mixer_unchecked)
from cb_kernels.ops.gated_rms_norm import gated_rms_norm_fast, gated_rms_norm_unchecked

logger = logging.getLogger("cb_kernels")

# False: every layer keeps the conv, scan and norm as separate calls with the split and gates in
# torch (the path before ops.fused_hybrid; tests and benchmarks compare the two).
FUSED = True


def _linear(runs, module, x):
    """module(x), or the packed GEMM `runs` maps it to (runner/hybrid_layers.py calls the kernels
    with the step's packed groups instead of installing their forwards on the modules)."""
    run = None if runs is None else runs.get(module)
    return module(x) if run is None else run(x)


def _project_fused(module, x, runs=None):
    """Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped by key head (the layer's own split).
    Returns the conv input [n, conv_dim] (q, k, v of every head, the conv's channel order: three
    copies into one buffer, where fix_query_key_value_ordering + cat made seven), z as (its
    tensor, token stride, block stride, value heads per block) for ops.gated_rms_norm to read
    in place, and b, a as [n, num_k_heads, ratio] views."""
    n, nk = x.shape[1], module.num_k_heads
    hk, hv, r = module.head_k_dim, module.head_v_dim, module.num_v_heads // module.num_k_heads
    width = 2 * hk + 2 * r * hv
    qkvz = _linear(runs, module.in_proj_qkvz, x)[0].view(n, nk, width)
    ba = _linear(runs, module.in_proj_ba, x)[0].view(n, nk, 2 * r)
    mixed = qkvz.new_empty((n, module.conv_dim))
    kd = module.key_dim
    mixed[:, :kd].view(n, nk, hk).copy_(qkvz[..., :hk])
    mixed[:, kd:2 * kd].view(n, nk, hk).copy_(qkvz[..., hk:2 * hk])
    mixed[:, 2 * kd:].view(n, nk, r * hv).copy_(qkvz[..., 2 * hk:2 * hk + r * hv])
    z = (qkvz[..., 2 * hk + r * hv:], nk * width, width, r)
    return mixed, z, ba[..., :r], ba[..., r:]


def _project_split(module, x, runs=None):
    """Qwen3.5: in_proj_qkv already in conv order; z, b, a projected apart."""
    z = _linear(runs, module.in_proj_z, x)[0]
    if z.stride(-1) != 1:           # the gated norm reads a gate row as contiguous channels
        z = z.contiguous()
    return (_linear(runs, module.in_proj_qkv, x)[0], (z, z.stride(0), 0, None),
            _linear(runs, module.in_proj_b, x)[0], _linear(runs, module.in_proj_a, x)[0])


def _param_key(module, names: tuple) -> tuple:
    """What changes when one of the module's parameters `names` is replaced or written in place
    (inference tensors have no version counter: Engine.weights_updated() for those)."""
    key = []
    for n in names:
        t = module._parameters.get(n)
        if t is None:            # a buffer, or a plain attribute
            t = getattr(module, n)
        key.append((t.data_ptr(), 0 if t.is_inference() else t._version))
    return tuple(key)


class _Derived:
    """fp32 tensors computed from a module's parameters once, again when one of them changes
    (each was 2-3 torch ops a layer a step: ~10-20 us apiece in a decode step whose state keeps
    the caches cold)."""

    def __init__(self, module, names: tuple, compute):
        self.module, self.names, self.compute = module, names, compute
        self.key, self.values = None, None

    def get(self):
        key = _param_key(self.module, self.names)
        if key != self.key:
            with torch.inference_mode():
                self.values = self.compute(self.module)
            self.key = key
        return self.values


def _fused_norm(norm, dtype, weight_len: int, grouped: bool) -> bool:
    """Whether `norm` is transformers' RMSNormGated that ops.gated_rms_norm computes: Qwen3-Next's
    (grouped False: per value head, SiLU gate after the norm) or the Mamba-2 mixers' (grouped:
    the gate first, over `_norm_group(norm)` elements), its weight [weight_len] of the layer's
    dtype. Else the layer keeps calling it (the construction probe checks the result either
    way), as it does where the op's fast body does not run (`gated_rms_norm_fast`)."""
    weight = getattr(norm, "weight", None)
    return (gated_rms_norm_fast()
            and type(norm).__name__.endswith("RMSNormGated")
            and (grouped or not hasattr(norm, "group_size"))
            and getattr(norm, "activation", "silu") == "silu"
            and isinstance(getattr(norm, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dtype == dtype
            and tuple(weight.shape) == (weight_len,))


def _fit(module, why_not_fused) -> str:
    """why_not_fused(module): "" where the layer's middle runs as one ops.fused_hybrid call,
    else why not (logged)."""
    try:
        why = why_not_fused(module)
    except AttributeError as e:      # a mixer class that names its parts otherwise
        why = f"it lacks {e}"
    if why:
        logger.info("%s: conv, scan and norm as separate calls (%s)", type(module).__name__, why)
    return why


def _norm_group(norm) -> int:
    """Elements a Mamba-2 mixer's gated norm normalises together: its `group_size` where it has
    one (transformers 5.24: intermediate_size // n_groups); transformers 5.17's
    MambaRMSNormGated has none and normalises the whole row."""
    return getattr(norm, "group_size", norm.weight.shape[0])


class GatedDeltaNetKernels:
    """The replacement forward of one gated delta-net module on its pool entry (conv state 0
    [num_slots, conv_dim, width], recurrent state 0 fp32 [num_slots, num_v_heads, k_dim,
    v_dim])."""

    ops = "causal_conv1d + gated_delta_rule"

    def __init__(self, module, entry: dict):
        self.module = module
        self.project = _project_fused if hasattr(module, "in_proj_qkvz") else _project_split
        self.conv_state = entry[("conv", 0)]
        self.state = entry[("recurrent", 0)]
        self.scale = module.head_k_dim ** -0.5
        # transformers' -A_log.float().exp(), the decay's factor
        self.neg_a = _Derived(module, ("A_log",), lambda m: -m.A_log.float().exp())
        self.why_not_fused = _fit(module, self._why_not_fused)

    @staticmethod
    def _why_not_fused(m) -> str:
        """"" when ops.gated_delta_net computes this layer's middle, else why not."""
        dtype = m.conv1d.weight.dtype
        if not hasattr(m, "in_proj_qkvz"):
            return "its projections are not Qwen3-Next's fused qkvz / ba"
        if not _fused_norm(m.norm, dtype, m.head_v_dim, grouped=False):
            return "its gated norm is not the one ops.gated_rms_norm computes fast here"
        dt_bias = m._parameters.get("dt_bias")
        if not isinstance(dt_bias, torch.Tensor) or dt_bias.dtype != dtype or \
                tuple(dt_bias.shape) != (m.num_v_heads,):
            return "its dt_bias is not a [num_v_heads] tensor of the layer's dtype"
        if m.conv1d.bias is not None and m.conv1d.bias.dtype != dtype:
            return "its conv bias has another dtype"
        return ""

    def __call__(self, hidden_states: torch.Tensor, rows, runs: Optional[dict] = None
                 ) -> torch.Tensor:
        """hidden_states: [1, num_tokens, hidden], the step's packed row; rows: the step's
        `VarlenRows`; runs: {linear module: packed GEMM} to call instead of the modules.
        Returns [1, num_tokens, hidden]."""
        m = self.module
        n = hidden_states.shape[1]
        if FUSED and not self.why_not_fused:
            qkvz = _linear(runs, m.in_proj_qkvz, hidden_states)[0]
            ba = _linear(runs, m.in_proj_ba, hidden_states)[0]
            normed = gated_delta_net_unchecked(
                qkvz, ba, m.conv1d.weight.squeeze(1), m.conv1d.bias, self.conv_state,
                self.state, m.dt_bias, self.neg_a.get(), m.norm.weight, rows.slots,
                rows.cu_seqlens, rows.has_state, m.num_k_heads, m.num_v_heads, m.head_k_dim,
                m.head_v_dim, self.scale, m.norm.variance_epsilon)
            return _linear(runs, m.out_proj, normed[None])
        mixed, z, b, a = self.project(m, hidden_states, runs)
        conv = ops.causal_conv1d_unchecked(mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias,
                                           self.conv_state, rows.slots, rows.cu_seqlens,
                                           rows.has_state, "silu")
        q = conv[:, :m.key_dim].view(n, m.num_k_heads, m.head_k_dim)
        k = conv[:, m.key_dim:2 * m.key_dim].view(n, m.num_k_heads, m.head_k_dim)
        v = conv[:, 2 * m.key_dim:].view(n, m.num_v_heads, m.head_v_dim)
        # b, a: [n, num_k_heads, ratio] views (strided in fp32, where .float() copies nothing)
        beta = b.sigmoid().float().reshape(n, m.num_v_heads)   # sigmoid in the model's dtype
        g = F.softplus(a.float().reshape(n, m.num_v_heads) + m.dt_bias)
        g.mul_(self.neg_a.get())
        core = torch.empty((n, m.num_v_heads, m.head_v_dim), dtype=v.dtype)
        ops.gated_delta_rule_unchecked(q, k, v, g, beta, self.state, rows.slots,
                                       rows.cu_seqlens, rows.has_state, core, self.scale)
        zt, token_stride, block_stride, per_block = z
        if _fused_norm(m.norm, core.dtype, m.head_v_dim, grouped=False):
            normed = gated_rms_norm_unchecked(
                core.view(n, -1), zt, m.norm.weight, m.norm.variance_epsilon,
                torch.empty((n, m.value_dim), dtype=core.dtype), m.head_v_dim, True,
                gate_token_stride=token_stride, gate_block_stride=block_stride,
                groups_per_block=per_block)
        else:
            normed = m.norm(core.reshape(-1, m.head_v_dim), zt.reshape(-1, m.head_v_dim))
        return _linear(runs, m.out_proj, normed.reshape(1, n, -1))

    def block(self, x, pending, rows, in_norm, post_norm, qkvz, ba, out_proj) -> torch.Tensor:
        """Qwen3NextDecoderLayer up to its MLP in one call (runner/hybrid_layers.py, where
        `why_not_fused` is ""): x [num_tokens, hidden] (contiguous) += pending, then += the
        mixer's output, in place; returns the post norm's [num_tokens, hidden]. in_norm,
        post_norm: the layer's Qwen3NextRMSNorm modules; qkvz, ba, out_proj: the projections'
        ops.PackedLinear."""
        m = self.module
        return gated_delta_net_block_unchecked(
            x, pending, in_norm.weight, in_norm.eps, post_norm.weight, post_norm.eps, qkvz, ba,
            out_proj, m.conv1d.weight.squeeze(1), m.conv1d.bias, self.conv_state, self.state,
            m.dt_bias, self.neg_a.get(), m.norm.weight, rows.slots, rows.cu_seqlens,
            rows.has_state, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim,
            self.scale, m.norm.variance_epsilon)

    def block_workspace_bytes(self, num_tokens: int, hidden: int) -> int:
        """Scratch bytes of a `block` call over num_tokens rows."""
        m = self.module
        return gated_delta_net_block_workspace_bytes(
            num_tokens, hidden, m.conv1d.weight.dtype, m.num_k_heads, m.num_v_heads,
            m.head_k_dim, m.head_v_dim, m.conv1d.weight.shape[-1], self.conv_state.shape[2])

    @staticmethod
    def state_shape(module) -> tuple:
        return (module.num_v_heads, module.head_k_dim, module.head_v_dim)

    @staticmethod
    def layout_error(module, conv, rec) -> str:
        if tuple(rec.shape[1:]) != GatedDeltaNetKernels.state_shape(module):
            return "its recurrent slots are not [num_v_heads, k_dim, v_dim]"
        if conv.shape[1] != module.conv_dim:
            return "its conv slots are not [conv_dim, width]"
        return ""


class VarlenRows:
    """The step's sequences in packed-row order, as the kernels take them: slots int64
    [num_seqs], cu_seqlens int32 [num_seqs + 1], has_state bool [num_seqs]."""

    def __init__(self, groups: list):
        if len(groups) == 1 and not isinstance(groups[0].rows, slice):
            # A decode-only step: its rows are usually the packed row's 0..n-1 in order, and
            # then the plan's slots tensor is the kernels' as it is (two .tolist() and three
            # tensors fewer a step); the offsets and flags of n rows are kept per n.
            g = groups[0]
            order, cu, ones = _decode_rows(g.rows.shape[0])
            if torch.equal(g.rows, order) and g.slots.dtype == torch.int64 and \
                    g.slots.is_contiguous():
                self.slots, self.cu_seqlens, self.has_state = g.slots, cu, ones
                return
        rows = []        # (start, length, slot, continuing)
        for g in groups:
            if isinstance(g.rows, slice):
                rows.append((g.rows.start, g.rows.stop - g.rows.start, int(g.slots[0]),
                             g.continuing))
            else:
                rows += [(r, 1, s, True) for r, s in zip(g.rows.tolist(), g.slots.tolist())]
        rows.sort()
        # the offsets summed here: a cumsum and a cast in torch were two more ops a step
        self.slots = torch.tensor([s for _, _, s, _ in rows], dtype=torch.int64)
        self.cu_seqlens = torch.tensor(list(accumulate((n for _, n, _, _ in rows), initial=0)),
                                       dtype=torch.int32)
        self.has_state = torch.tensor([c for _, _, _, c in rows], dtype=torch.bool)


@functools.lru_cache(maxsize=64)
def _decode_rows(n: int) -> tuple:
    """(rows 0..n-1 int64, cu_seqlens 0..n int32, has_state all True) of n decode rows (read
    only: the kernels never write them)."""
    return (torch.arange(n, dtype=torch.int64), torch.arange(n + 1, dtype=torch.int32),
            torch.ones(n, dtype=torch.bool))


def varlen_rows(step) -> VarlenRows:
    """The step's VarlenRows, built once per step (kept on the StateStep)."""
    if step.varlen is None:
        step.varlen = VarlenRows(step.groups)
    return step.varlen


class Mamba2Kernels:
    """The replacement forward of one Mamba-2 mixer (Mamba2, Bamba, Granite-MoE-hybrid, Nemotron-H:
    transformers' one copied code) on its pool entry (conv state 0 [num_slots, conv_dim, width],
    recurrent state 0 fp32 [num_slots, num_heads, head_dim, d_state])."""

    ops = "causal_conv1d + selective_scan"

    def __init__(self, module, entry: dict):
        self.module = module
        self.conv_state = entry[("conv", 0)]
        self.state = entry[("recurrent", 0)]
        # -exp(A_log), D and dt_bias in fp32, as transformers reads them
        self.consts = _Derived(module, ("A_log", "D", "dt_bias"), lambda m: (
            -torch.exp(m.A_log.float()), m.D.float().contiguous(),
            m.dt_bias.float().contiguous()))
        self.why_not_fused = _fit(module, self._why_not_fused)

    @staticmethod
    def _why_not_fused(m) -> str:
        """"" when ops.mamba2_mixer computes this mixer's middle, else why not."""
        dtype = m.conv1d.weight.dtype
        width = m.in_proj.weight.shape[0]
        if width != m.intermediate_size + m.conv_dim + m.num_heads:
            return f"its in_proj width {width} is not gate + xBC + dt"
        if not _fused_norm(m.norm, dtype, m.intermediate_size, grouped=True):
            return "its gated norm is not the one ops.gated_rms_norm computes fast here"
        if m.intermediate_size % _norm_group(m.norm) or m.num_heads % m.n_groups:
            return "its norm groups or head groups do not divide"
        if m.conv1d.bias is not None and m.conv1d.bias.dtype != dtype:
            return "its conv bias has another dtype"
        return ""

    def __call__(self, hidden_states: torch.Tensor, rows, runs: Optional[dict] = None
                 ) -> torch.Tensor:
        m = self.module
        n = hidden_states.shape[1]
        projected = _linear(runs, m.in_proj, hidden_states)[0]
        if FUSED and not self.why_not_fused and projected.dtype == m.conv1d.weight.dtype:
            neg_a, d, dt_bias = self.consts.get()
            y = mamba2_mixer_unchecked(
                projected, m.conv1d.weight.squeeze(1), m.conv1d.bias, self.conv_state,
                self.state, neg_a, d, dt_bias, m.norm.weight, rows.slots, rows.cu_seqlens,
                rows.has_state, m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size,
                _norm_group(m.norm), m.norm.variance_epsilon)
            return _linear(runs, m.out_proj, y[None])
        gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        conv = ops.causal_conv1d_unchecked(xbc, m.conv1d.weight.squeeze(1), m.conv1d.bias,
                                           self.conv_state, rows.slots, rows.cu_seqlens,
                                           rows.has_state, "silu")
        bc = m.n_groups * m.ssm_state_size
        x = conv[:, :m.intermediate_size].view(n, m.num_heads, m.head_dim)
        B = conv[:, m.intermediate_size:m.intermediate_size + bc].view(n, m.n_groups, -1)
        C = conv[:, m.intermediate_size + bc:].view(n, m.n_groups, -1)
        neg_a, d, dt_bias = self.consts.get()
        y = ops.selective_scan(x, dt.float().contiguous(), neg_a, B, C,
                               self.state, rows.slots, rows.cu_seqlens, rows.has_state,
                               D=d, dt_bias=dt_bias)
        y = y.view(n, -1)
        if gate.dtype == y.dtype and _fused_norm(m.norm, y.dtype, m.intermediate_size,
                                                 grouped=True):
            y = gated_rms_norm_unchecked(y, gate, m.norm.weight, m.norm.variance_epsilon,
                                         torch.empty_like(y), _norm_group(m.norm), False,
                                         gate_token_stride=gate.stride(0))
        else:
            y = m.norm(y[None], gate[None])[0]
        return _linear(runs, m.out_proj, y.to(hidden_states.dtype)[None])

    def block(self, x: torch.Tensor, rows, norm, in_proj, out_proj) -> torch.Tensor:
        """The whole Mamba2Block around this mixer in one call (runner/hybrid_layers.py, where
        `why_not_fused` is ""): x [num_tokens, hidden] (contiguous; fp32 with the fp32
        residual stream) += out_proj(mixer(in_proj(norm(x)))) in place; norm: the block's
        RMSNorm module; in_proj, out_proj: their ops.PackedLinear."""
        m = self.module
        neg_a, d, dt_bias = self.consts.get()
        return mamba2_block_unchecked(
            x, norm.weight, norm.variance_epsilon, in_proj, out_proj, m.conv1d.weight.squeeze(1),
            m.conv1d.bias, self.conv_state, self.state, neg_a, d, dt_bias, m.norm.weight,
            rows.slots, rows.cu_seqlens, rows.has_state, m.num_heads, m.head_dim, m.n_groups,
            m.ssm_state_size, _norm_group(m.norm), m.norm.variance_epsilon)

    def block_workspace_bytes(self, num_tokens: int, hidden: int) -> int:
        """Scratch bytes of a `block` call over num_tokens rows."""
        m = self.module
        return mamba2_block_workspace_bytes(
            num_tokens, hidden, m.conv1d.weight.dtype, m.num_heads, m.head_dim, m.n_groups,
            m.ssm_state_size, _norm_group(m.norm), m.conv1d.weight.shape[-1],
            self.conv_state.shape[2])

    @staticmethod
    def state_shape(module) -> tuple:
        return (module.num_heads, module.head_dim, module.ssm_state_size)

    @staticmethod
    def layout_error(module, conv, rec) -> str:
        if tuple(module.time_step_limit) != (0.0, float("inf")):
            # transformers clamps dt in its prefill path only (not in the one-token update)
            return f"its time_step_limit {tuple(module.time_step_limit)} is not (0, inf)"
        if tuple(rec.shape[1:]) != Mamba2Kernels.state_shape(module):
            return "its recurrent slots are not [num_heads, head_dim, d_state]"
        if conv.shape[1] != module.conv_dim:
            return "its conv slots are not [conv_dim, width]"
        return ""


_KERNELS = {"Qwen3NextGatedDeltaNet": GatedDeltaNetKernels,
            "Qwen3_5GatedDeltaNet": GatedDeltaNetKernels,
            "Qwen3_5MoeGatedDeltaNet": GatedDeltaNetKernels,
            "Mamba2Mixer": Mamba2Kernels, "BambaMixer": Mamba2Kernels,
            "GraniteMoeHybridMambaLayer": Mamba2Kernels, "NemotronHMamba2Mixer": Mamba2Kernels}


def why_not(module, entry: Optional[dict]) -> str:
    """"" when `module` can run on the kernels with this pool entry, else why not."""
    name = type(module).__name__
    kind = _KERNELS.get(name)
    if kind is None:
        return "no kernel path for this layer class"
    if entry is None or set(entry) != {("conv", 0), ("recurrent", 0)}:
        return "its state is not one conv window and one recurrent state"
    weight = module.conv1d.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return f"its weights are {weight.dtype} on {weight.device} (kernels: fp32/bf16 CPU)"
    if module.activation != "silu" or weight.shape[-1] > 16:
        return f"its conv ({module.activation}, width {weight.shape[-1]}) is not SiLU <= 16"
    conv, rec = entry[("conv", 0)], entry[("recurrent", 0)]
    if rec.dtype != torch.float32 or conv.dtype != weight.dtype:
        return f"its slots are {conv.dtype} / {rec.dtype} (kernels: the weights' dtype / fp32)"
    return kind.layout_error(module, conv, rec) or _probe(module, kind)


def _probe(module, kind) -> str:
    """The module's own forward (no cache: transformers' chunked path from zero state) on 7
    random tokens against the kernels on a scratch slot: the first 4 tokens as a fresh prefill,
    then 2 as a continued chunk, then 1 as a decode."""
    from cb_kernels.runner.state_cache import _Group

    weight = module.conv1d.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 7, module.hidden_size, generator=gen).to(weight.dtype)
    width = weight.shape[-1]
    entry = {("conv", 0): torch.zeros(1, module.conv_dim, width, dtype=weight.dtype),
             ("recurrent", 0): torch.zeros(1, *kind.state_shape(module))}
    kernels = kind(module, entry)
    slot = torch.zeros(1, dtype=torch.int64)
    with torch.inference_mode():
        want = type(module).forward(module, x)
        got = torch.cat([kernels(x[:, a:e], VarlenRows([_Group(slice(0, e - a), slot, a > 0)]))
                         for a, e in ((0, 4), (4, 6), (6, 7))], dim=1)
    rtol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    err = (got.float() - want.float()).abs().max().item()
    bound = rtol * want.float().abs().max().item() + 1e-6
    if not err <= bound:
        return f"the kernels differ from its own forward by {err:.3g} (allowed {bound:.3g})"
    return ""


def kernel_for(module, entry: Optional[dict]) -> tuple:
    """(the kernels' forward for `module`, "") or (None, why not)."""
    reason = why_not(module, entry)
    return (None, reason) if reason else (_KERNELS[type(module).__name__](module, entry), "")


def describe(wrapped: list) -> list:
    """One line per stateful layer class: which path it runs (for the runner's log); wrapped:
    state_switch._Wrapped objects (their `kernel` and `kernel_reason`)."""
    lines: dict = {}
    for w in wrapped:
        name = type(w.module).__name__
        lines.setdefault(name, f"{name}: cb_kernels' {w.kernel.ops}" if w.kernel is not None
                         else f"{name}: transformers' code ({w.kernel_reason})")
    return list(lines.values())
