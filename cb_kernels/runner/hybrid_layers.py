"""The engine's own decoder forward for hybrid families (Qwen3-Next, Mamba-2), CPU fp32 or bf16.

Why: with the stateful layers on our kernels (hybrid_kernels.py), the linears packed and the MoE
on ops.moe_experts, what stayed serial in a step was transformers' decoder code around them: its
RMSNorms in fp32 with casts, residual adds, module calls and their decorators, the masks, the
router's softmax/top-k, rotary, the forward patches installed and removed each step (attention,
state wrappers, packed forwards). On the bench's Qwen3-Next hd128 shape (4 layers, hidden 256,
16-row bf16 decode, Zen 4) that glue was 4.65 / 3.00 ms of an 11.1 / 6.7 ms step at 1 / 2
threads (bench/RESULTS.md "Where a step goes"), which bounded two threads at ~1.4x one. Here
each layer is a dozen calls on the step's packed row: the norms with the residual add as one
C++ pass (ops.rms_norm; Qwen3-Next's (1 + w) norm on ops.offset_rms_norm: fp32 math rounded
once, as transformers computes it), the mixer kernels as before, the packed linears called directly,
the router's softmax/top-k as one call (ops.moe_route) and the experts on their packed
groups, attention through the paged kernels. Where the linears are on our GEMM, a Mamba-2 block
and a Qwen3-Next gated delta-net layer up to its MLP are each one C++ call (ops.fused_hybrid,
the same bits as the calls apart): glue 1.21-1.26 -> 0.80-0.87 ms a step on the bench shape.

Exactness: the same formulas as transformers' modules, rounded where they round (bf16: the
residual adds in bf16 for Qwen3-Next, in fp32 for Mamba-2's `residual_in_fp32`); the sums of
the norms in another order (fp32 rounding). fp32 tokens equal per-prompt `generate`
(tests/engine/test_hybrid_layers.py).

It runs only where the model is exactly what it assumes: the family's own classes (not
subclasses), every stateful layer on our kernels, every linear packed, the MoE blocks on our
router and experts groups, attention layers with no window, chunk or softcap, no hooks or
instance forwards anywhere. Anything else keeps transformers' forward, and `build` logs why
(`why_not`). Rows come out after the final norm; the runner's LM head takes them from there.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.ops.gated_attention import (gated_attention_block_unchecked,
                                            gated_attention_block_workspace_bytes)
from cb_kernels.ops.moe import moe_route_unchecked
from cb_kernels.ops.moe_block import moe_block_unchecked, torch_scalar_rows
from cb_kernels.ops.offset_rms_norm import offset_rms_norm_unchecked
from cb_kernels.runner import hybrid_kernels, hybrid_stack, moe_layers
from cb_kernels.runner.fused.forward import _RotaryTable
from cb_kernels.runner.moe_layers import ExpertsGroup, RouterGroup
from cb_kernels.runner.packed_linears import has_hooks

logger = logging.getLogger("cb_kernels")

# False: every step keeps transformers' forward (benchmarks and tests compare the two).
ENABLED = True
# False: Qwen3-Next's attention layers run as separate calls, not one ops.gated_attention_block
# call each (benchmarks and tests compare the two).
FUSED_ATTENTION = True


class _Mismatch(Exception):
    """The model is not what this forward assumes (the message says where)."""


def _own(module, cls_name: str, family: str):
    """module, when it is exactly transformers' `cls_name` of `family`'s modeling file."""
    want = f"transformers.models.{family}.modeling_{family}"
    if module is None or type(module).__name__ != cls_name or type(module).__module__ != want:
        raise _Mismatch(f"{type(module).__name__} where {family}'s {cls_name} was expected")
    return module


def _weight(norm, dtype) -> torch.Tensor:
    w = norm._parameters.get("weight")
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != dtype:
        raise _Mismatch(f"{type(norm).__name__}'s weight is not a [dim] {dtype} tensor")
    return w


class _Runs:
    """The packed GEMM of each linear this forward calls (group.run; a fused group once)."""

    def __init__(self, packed):
        self.packed = packed

    def single(self, module):
        group = self.packed.group_of(module)
        if group is None or group.members != [module]:
            raise _Mismatch(f"a {type(module).__name__} that is not packed on its own")
        return group

    def fused(self, modules: list):
        group = self.packed.group_of(modules[0])
        if group is None or group.members != modules:
            raise _Mismatch("sibling projections not packed as one group")
        return group


class _OffsetNorm:
    """Qwen3-Next's RMSNorm on ops.offset_rms_norm: fp32 math, times (1 + weight) in fp32, one
    rounding to x's dtype, the residual add (in x's dtype, as transformers' `residual + h`) in
    the same pass."""

    def __init__(self, module, dtype):
        self.module = module
        self.eps = module.eps
        if not isinstance(self.eps, float):
            raise _Mismatch("a norm without a float eps")
        _weight(module, dtype)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [rows, dim] with packed rows (any row stride), updated in place to x + residual
        when one is given. Returns a new contiguous [rows, dim]."""
        w = self.module._parameters["weight"]
        return offset_rms_norm_unchecked(x, w if w.is_contiguous() else w.contiguous(),
                                         self.eps, residual)


class _PlainNorm:
    """Mamba-2's RMSNorm (LlamaRMSNorm's formula: weight * round(x * r)) on ops.rms_norm."""

    def __init__(self, module, dtype):
        self.module, self.eps = module, module.variance_epsilon
        if not isinstance(self.eps, float):
            raise _Mismatch("a norm without a float eps")
        _weight(module, dtype)

    def __call__(self, x, residual=None):
        return ops.rms_norm_unchecked(x, self.module.weight, self.eps, residual)


def _silu(act) -> bool:
    probe = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        return callable(act) and torch.equal(act(probe), F.silu(probe))


class _Qwen3NextLayer:
    def __init__(self, layer, idx: int, cfg, kernels: dict, runs: _Runs, experts: dict,
                 dtype, layout):
        fam = "qwen3_next"
        _own(layer, "Qwen3NextDecoderLayer", fam)
        self.in_norm = _OffsetNorm(_own(layer.input_layernorm, "Qwen3NextRMSNorm", fam), dtype)
        self.post_norm = _OffsetNorm(_own(layer.post_attention_layernorm, "Qwen3NextRMSNorm",
                                          fam), dtype)
        self.idx, self.dtype = idx, dtype
        self.linear = layer.block_type == "linear_attention"
        if self.linear:
            mixer = _own(layer.linear_attn, "Qwen3NextGatedDeltaNet", fam)
            self.kernel = kernels.get(mixer)
            if self.kernel is None:
                raise _Mismatch(f"layer {idx}'s gated delta-net is not on our kernels")
            self.groups = [runs.single(m) for m in (mixer.in_proj_qkvz, mixer.in_proj_ba,
                                                     mixer.out_proj)]
            self.runs = {g.members[0]: g.run for g in self.groups}
        elif layer.block_type == "full_attention":
            attn = _own(layer.self_attn, "Qwen3NextAttention", fam)
            self.qkv = runs.fused([attn.q_proj, attn.k_proj, attn.v_proj])
            self.o = runs.single(attn.o_proj)
            self.q_norm = _OffsetNorm(_own(attn.q_norm, "Qwen3NextRMSNorm", fam), dtype)
            self.k_norm = _OffsetNorm(_own(attn.k_norm, "Qwen3NextRMSNorm", fam), dtype)
            self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)
            self.num_heads = cfg.num_attention_heads
            self.num_kv_heads = cfg.num_key_value_heads
            if layout.sliding_windows[idx] is not None or layout.softcap is not None or \
                    (idx < len(layout.chunked_layers) and layout.chunked_layers[idx]):
                raise _Mismatch(f"layer {idx}'s attention has a window, chunk or softcap")
            if layout.backend not in (None, "cpu"):
                raise _Mismatch(f"attention backend {layout.backend!r} (this forward: cpu)")
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.splits = [2 * q_size, kv_size, kv_size]
            if self.qkv.splits != self.splits:
                raise _Mismatch(f"layer {idx}'s q/k/v widths {self.qkv.splits}")
            # Up to its MLP in one call where both projections are on our GEMM (their packed
            # weights are what the call reads), else the separate calls.
            self.why_not_fused = "" if self.qkv.lin is not None and self.o.lin is not None \
                else "its projections are not on ops.PackedLinear"
            if self.why_not_fused:
                logger.info("layer %d's attention: separate calls (%s)", idx, self.why_not_fused)
        else:
            raise _Mismatch(f"layer type {layer.block_type!r}")
        mlp = layer.mlp
        self.moe = type(mlp).__name__ == "Qwen3NextSparseMoeBlock"
        if self.moe:
            _own(mlp, "Qwen3NextSparseMoeBlock", fam)
            # Routers and experts off our packed ops (their SIMD bodies do not run here, or
            # moe_layers.MOE = "off") keep transformers' formula: F.linear for the logits, the
            # experts module's own forward.
            self.gate = _own(mlp.gate, "Qwen3NextTopKRouter", fam)
            self.router = experts.get(mlp.gate)
            self.experts = experts.get(mlp.experts)
            if not isinstance(self.router, RouterGroup):
                self.router = None
            if not isinstance(self.experts, ExpertsGroup):
                self.experts = None
                self.experts_module = _own(mlp.experts, "Qwen3NextExperts", fam)
            self.shared_gate = runs.single(mlp.shared_expert_gate)
            dense = _own(mlp.shared_expert, "Qwen3NextMLP", fam)
        else:
            dense = _own(mlp, "Qwen3NextMLP", fam)
        self.gate_up = runs.fused([dense.gate_proj, dense.up_proj])
        self.down = runs.single(dense.down_proj)
        if not _silu(dense.act_fn):
            raise _Mismatch(f"layer {idx}'s MLP activation is not SiLU")
        # The whole MLP as one ops.moe_block call (moe_layers.BLOCK) where every part is on our
        # packed ops; steps of block_rows rows or more keep the calls apart, whose sigmoid gate
        # torch then computes with a vectorised exp (ops/moe_block.py `torch_scalar_rows`).
        self.block_rows = torch_scalar_rows(dtype) if self.moe else None
        why = None
        if self.moe and (self.router is None or self.experts is None):
            why = "its router or experts are not on our packed ops"
        elif any(g.lin is None for g in [self.gate_up, self.down] +
                 ([self.shared_gate] if self.moe else [])):
            why = "its linears are not on our GEMM"
        if why is not None:
            logger.info("hybrid forward: layer %d's MLP runs as separate calls (%s)", idx, why)
        elif idx == 0:
            logger.info("hybrid forward: each MLP in one ops.moe_block call%s", "" if not
                        self.moe else f" on steps of < {self.block_rows} rows")
        self.block_fits = why is None       # the groups' `lin` are read again at each call

    def block_linears(self):
        """(qkvz, ba, out_proj) as ops.PackedLinear when this gated delta-net layer up to its
        MLP can run as one ops.fused_hybrid call (our GEMM packed all three, the mixer's middle
        fits), else None."""
        if not self.linear or not hybrid_kernels.FUSED or self.kernel.why_not_fused:
            return None
        lins = tuple(g.lin for g in self.groups)
        return None if any(lin is None for lin in lins) else lins

    def attention_linears(self):
        """(qkv, o_proj) as ops.PackedLinear when this attention layer up to its MLP runs as
        one ops.gated_attention_block call, else None."""
        if self.linear or not FUSED_ATTENTION or self.why_not_fused:
            return None
        qkv, o = self.qkv.lin, self.o.lin
        return None if qkv is None or o is None else (qkv, o)

    def mlp_parts(self):
        """(gate_up, down, shared_gate, router, experts) when the MLP runs as one ops.moe_block
        call on steps of fewer than `block_rows` rows (every step when block_rows is None): the
        PackedLinears (a dense MLP: shared_gate and router None) and the ops.PackedExperts
        (None for a dense MLP); else None."""
        if not self.block_fits or not moe_layers.BLOCK:
            return None
        parts = (self.gate_up.lin, self.down.lin)
        if self.moe:
            parts += (self.shared_gate.lin, self.router.lin, self.experts.experts)
            return parts if all(v is not None for v in parts) else None
        return parts + (None, None, None) if all(v is not None for v in parts) else None

    def workspace_bytes(self, num_tokens: int, num_seqs: int, hidden: int) -> int:
        """Scratch bytes (ops/workspace.py) of this layer's one-call path over a step of
        num_tokens rows and num_seqs sequences; 0 where it runs the separate calls."""
        if self.linear:
            lins = self.block_linears()
            return 0 if lins is None else self.kernel.block_workspace_bytes(num_tokens, hidden)
        if self.attention_linears() is None:
            return 0
        return gated_attention_block_workspace_bytes(num_tokens, num_seqs, hidden,
                                                     self.num_heads, self.num_kv_heads,
                                                     self.head_dim, self.dtype)

    def attention(self, x, pending, cos, sin, step) -> torch.Tensor:
        """Qwen3NextDecoderLayer up to its MLP on the paged cache: x [T, hidden] += pending,
        then += Qwen3NextAttention(in_norm(x)), in place; returns post_norm(x) [T, hidden]. One
        ops.gated_attention_block call where it fits (the same bits as the calls below)."""
        k_cache, v_cache = step.layout.k_caches[self.idx], step.layout.v_caches[self.idx]
        lins = self.attention_linears()
        if lins is not None:
            qkv, o = lins
            norms = [n.module._parameters["weight"] for n in (self.in_norm, self.post_norm,
                                                               self.q_norm, self.k_norm)]
            norms = [w if w.is_contiguous() else w.contiguous() for w in norms]
            return gated_attention_block_unchecked(
                x, pending, norms[0], norms[1], qkv.packed, qkv.bias, o.packed, o.bias, norms[2],
                norms[3], cos, sin, k_cache, v_cache, step.slot_mapping, step.block_tables,
                step.seq_lens, step.cu_seqlens_q, self.num_heads,
                (self.in_norm.eps, self.post_norm.eps, self.q_norm.eps, self.k_norm.eps),
                self.scaling)
        h = self.in_norm(x, pending)
        n, hd = h.shape[0], self.head_dim
        qg, k, v = self.qkv.run(h).split(self.splits, dim=-1)
        qg = qg.view(n, self.num_heads, 2 * hd)
        q = self.q_norm(qg[..., :hd].reshape(-1, hd)).view(n, self.num_heads, hd)
        k = self.k_norm(k.reshape(-1, hd)).view(n, self.num_kv_heads, hd)
        v = v.view(n, self.num_kv_heads, hd)
        rd = cos.shape[-1]       # partial rotary: the first rd dims of each head
        ops.rope_(q[..., :rd], cos, sin)
        ops.rope_(k[..., :rd], cos, sin)
        ops.write_kv_unchecked(k, v, k_cache, v_cache, step.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                  step.cu_seqlens_q, scale=self.scaling, backend="cpu")
        out = out.view(n, -1).mul_(qg[..., hd:].reshape(n, -1).sigmoid())
        return self.post_norm(x, self.o.run(out))

    def mlp(self, h) -> torch.Tensor:
        """The layer's MLP on h [T, hidden] (contiguous) -> a new [T, hidden]: one
        ops.moe_block call where it fits, else the calls apart (the same bits)."""
        parts = self.mlp_parts()
        if parts is not None and (not self.moe or h.shape[0] < self.block_rows):
            gate_up, down, gate, router, experts = parts
            if not self.moe:
                return moe_block_unchecked(h, gate_up, down, None, None, 0, True, None)
            return moe_block_unchecked(h, gate_up, down, gate, router, self.gate.top_k,
                                       bool(self.gate.norm_topk_prob), experts)
        shared = self.down.run(ops.silu_mul(self.gate_up.run(h)))
        if not self.moe:
            return shared
        gate = self.gate
        logits = self.router.lin.run_unchecked(h) if self.router is not None \
            else F.linear(h, gate.weight)
        weights, index = moe_route_unchecked(logits, gate.top_k, bool(gate.norm_topk_prob))
        if self.experts is not None:
            routed = self.experts.experts.run_unchecked(h, index, weights)
        else:      # transformers' experts take the weights in the router's dtype
            routed = self.experts_module(h, index, weights.to(logits.dtype))
        shared.mul_(self.shared_gate.run(h).sigmoid())
        return routed.add_(shared)


class _Mamba2Layer:
    def __init__(self, block, idx: int, kernels: dict, runs: _Runs, dtype):
        fam = "mamba2"
        _own(block, "Mamba2Block", fam)
        self.norm = _PlainNorm(_own(block.norm, "Mamba2RMSNorm", fam), dtype)
        mixer = _own(block.mixer, "Mamba2Mixer", fam)
        self.kernel = kernels.get(mixer)
        if self.kernel is None:
            raise _Mismatch(f"layer {idx}'s mixer is not on our kernels")
        self.in_group, self.out_group = runs.single(mixer.in_proj), runs.single(mixer.out_proj)
        self.runs = {mixer.in_proj: self.in_group.run, mixer.out_proj: self.out_group.run}
        self.residual_in_fp32 = bool(block.residual_in_fp32)

    def block_linears(self):
        """(in_proj, out_proj) as ops.PackedLinear when the whole block can run as one
        ops.fused_hybrid call (our GEMM packed both, the mixer's middle fits), else None."""
        if not hybrid_kernels.FUSED or self.kernel.why_not_fused:
            return None
        lin_in, lin_out = self.in_group.lin, self.out_group.lin
        return None if lin_in is None or lin_out is None else (lin_in, lin_out)

    def workspace_bytes(self, num_tokens: int, num_seqs: int, hidden: int) -> int:
        """As _Qwen3NextLayer.workspace_bytes."""
        lins = self.block_linears()
        return 0 if lins is None else self.kernel.block_workspace_bytes(num_tokens, hidden)


class HybridForward:
    """Callable (input_ids [T], positions [T], logits_indices [S], AttentionMetadata,
    StateStep) -> the final-norm hidden rows [S, hidden] of the sampled tokens."""

    # The CausalLM classes it is written for (their LM head reads these rows as they are).
    CLASSES = ("Qwen3NextForCausalLM", "Mamba2ForCausalLM")

    def __init__(self, model, family: str, embed, layers: list, final_norm, rotary, dtype):
        self.model, self.family, self.embed = model, family, embed
        self.layers, self.final_norm, self.dtype = layers, final_norm, dtype
        # Mamba-2's final norm on the fp32 stream reads its weight in fp32: converted once, again
        # when the weight changes (a .float() a step cost ~20-40 us in a decode step).
        self.final_w32 = hybrid_kernels._Derived(final_norm.module, ("weight",),
                                                 lambda m: m.weight.float())
        self.rotary = _RotaryTable(rotary) if rotary is not None else None
        self.modules = list(model.modules())
        # Every layer and the final norm as one call, where they fit (hybrid_stack.py)
        if family == "mamba2":
            self.stack = hybrid_stack.Mamba2StackRun(layers, embed, final_norm, self.final_w32,
                                                     dtype)
        else:
            self.stack = hybrid_stack.Qwen3NextStackRun(layers, embed, final_norm, self.rotary,
                                                        dtype)

    @classmethod
    def build(cls, model, packed, wrapped: list, layout) -> Optional["HybridForward"]:
        """wrapped: the StateSwitch's (module, _Wrapped) pairs (their `kernel`); layout: the
        runner's LayerLayout. None (the reason logged) where the model does not fit."""
        if not ENABLED:
            return None
        try:
            return cls._build(model, packed, wrapped, layout)
        except _Mismatch as e:
            logger.info("hybrid forward: transformers' decoder code runs the steps (%s)", e)
            return None

    @classmethod
    def _build(cls, model, packed, wrapped, layout):
        if packed is None:
            raise _Mismatch("the linears are not packed")
        if has_hooks(list(model.modules())):
            raise _Mismatch("a hook or an instance forward on the model")
        kernels = {m: w.kernel for m, w in wrapped if w.kernel is not None}
        runs = _Runs(packed)
        experts = {g.members[0]: g for g in packed.experts}
        dtype = model.get_input_embeddings().weight.dtype
        name = type(model).__name__
        if name == "Qwen3NextForCausalLM":
            _own(model, name, "qwen3_next")
            d = _own(model.model, "Qwen3NextModel", "qwen3_next")
            cfg = model.config
            layers = [_Qwen3NextLayer(layer, i, cfg, kernels, runs, experts, dtype, layout)
                      for i, layer in enumerate(d.layers)]
            final = _OffsetNorm(_own(d.norm, "Qwen3NextRMSNorm", "qwen3_next"), dtype)
            embed, rotary, family = d.embed_tokens, d.rotary_emb, "qwen3_next"
            if len(layers) != cfg.num_hidden_layers:
                raise _Mismatch("the decoder holds another number of layers than its config")
        elif name == "Mamba2ForCausalLM":
            _own(model, name, "mamba2")
            d = _own(model.backbone, "Mamba2Model", "mamba2")
            layers = [_Mamba2Layer(b, i, kernels, runs, dtype) for i, b in enumerate(d.layers)]
            final = _PlainNorm(_own(d.norm_f, "Mamba2RMSNorm", "mamba2"), dtype)
            embed, rotary, family = d.embeddings, None, "mamba2"
        else:
            raise _Mismatch(f"no hybrid forward for {name}")
        if type(embed) is not torch.nn.Embedding or embed.weight.dtype != dtype:
            raise _Mismatch("the input embedding is not a plain nn.Embedding of the model's dtype")
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.weight.dtype != dtype:
            raise _Mismatch("the LM head is not a linear of the model's dtype")
        logger.info("hybrid forward: %d %s layers on cb_kernels' own decoder forward",
                    len(layers), family)
        return cls(model, family, embed, layers, final, rotary, dtype)

    def workspace_bytes(self, num_tokens: int, num_seqs: int) -> int:
        """The largest scratch (ops/workspace.py) a step of num_tokens rows over num_seqs
        sequences takes on this forward's one-call paths (the fused blocks and attention, the
        Mamba-2 and Qwen3-Next stacks), as they are now."""
        hidden = self.embed.weight.shape[1]
        need = max(layer.workspace_bytes(num_tokens, num_seqs, hidden) for layer in self.layers)
        if self.stack is not None and need:
            # the stack's: its largest layer's, plus x, the sampled rows and their norm
            # (csrc/cpu/mamba2_stack.cpp), or x, h, the MLP's output and the sampled rows of x
            # and of it (csrc/cpu/qwen3_next_stack.cpp); counted in fp32 and 64-byte aligned;
            # not built here (it is, with its log line, by the first step)
            streams = 1 if self.family == "mamba2" else 3
            need += 5 * 64 + 4 * hidden * (streams * num_tokens + 2 * num_seqs)
        return need

    def usable(self) -> bool:
        """False once a forward hook or an instance forward was added (this path would skip it)."""
        return not has_hooks(self.modules)

    @torch.inference_mode()
    def __call__(self, input_ids, positions, logits_indices, step, state) -> torch.Tensor:
        rows = hybrid_kernels.varlen_rows(state)
        if self.family == "mamba2":
            out = self.stack(input_ids, logits_indices, rows)
        else:
            out = self.stack(input_ids, positions, logits_indices, rows, step)
        if out is not None:
            return out
        x = F.embedding(input_ids, self.embed.weight)          # [T, hidden], a fresh tensor
        if self.family == "qwen3_next":
            x = self._qwen3_next(x, positions, step, rows)
        else:
            x = self._mamba2(x, rows)
        return x.index_select(0, logits_indices)

    def _qwen3_next(self, x, positions, step, rows):
        cos, sin = self.rotary(x, positions)
        pending = None       # the last sublayer's output, added into x by the next norm
        for layer in self.layers:
            lins = layer.block_linears()
            if lins is not None:         # the layer up to its MLP in one C++ call
                h = layer.kernel.block(x, pending, rows, layer.in_norm.module,
                                       layer.post_norm.module, *lins)
                pending = layer.mlp(h)
                continue
            if not layer.linear:         # up to its MLP (one C++ call where it fits)
                pending = layer.mlp(layer.attention(x, pending, cos, sin, step))
                continue
            h = layer.in_norm(x, pending)
            o = layer.kernel(h[None], rows, layer.runs)[0]
            h = layer.post_norm(x, o)
            pending = layer.mlp(h)
        return self.final_norm(x, pending)

    def _mamba2(self, x, rows):
        # transformers: residual = x (fp32 with residual_in_fp32), h = norm(x.to(norm dtype)),
        # x = residual + mixer(h); the final norm on the fp32 stream, cast for the LM head.
        for layer in self.layers:
            lins = layer.block_linears()
            if lins is not None:         # the whole block in one C++ call, x updated in place
                if layer.residual_in_fp32 and x.dtype != torch.float32:
                    x = x.float()
                layer.kernel.block(x, rows, layer.norm.module, *lins)
                continue
            h = layer.norm(x if x.dtype == self.dtype else x.to(self.dtype))
            if layer.residual_in_fp32:
                x = x.float()            # a no-op from the second layer on
            o = layer.kernel(h[None], rows, layer.runs)[0]
            x = x.add_(o) if x.dtype == torch.float32 or x.dtype == o.dtype else x + o
        if x.dtype != self.dtype:
            w = self.final_w32.get()
            return ops.rms_norm_unchecked(x, w, self.final_norm.eps).to(self.dtype)
        return self.final_norm(x)
