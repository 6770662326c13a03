"""The engine's Mamba-2 and Qwen3-Next forwards as one C++ call a step (ops.Mamba2Stack,
ops.Qwen3NextStack), for runner/hybrid_layers.py.

Why: with each Mamba-2 block one C++ call, the Python around them (the embedding, the fp32 cast,
a wrapper a layer, the final norm, its cast, the row selection) is serial at any thread count.
Here the layers' tensors are resolved into one ops.Mamba2Stack, kept while nothing it reads
changed, and a step is one call: the forward's glue of a 16-row bf16 decode step on the bench's
ds128 shape from 0.32-0.40 to 0.18-0.23 ms, the step 3-9% shorter at 1 and 2 threads
(bench_hybrid_step.py --blocks, Zen 4, load ~2). Qwen3-Next's (bf16, the bench's hd128 shape,
--layers --rounds 5, load ~1): its glue 0.48-0.51 -> 0.33-0.34 ms at 1 thread, the decode step
5-7% shorter at 1 thread and 7-11% at 2.

What "changed" means: a parameter the stack reads replaced or re-pointed (its object, address)
or written through torch (its version counter), a packed linear repacked (runner/packed_linears
makes a new PackedLinear: the runner refreshes them before the step), a state slot tensor moved
(sleep / wake_up re-point the pool). Writes torch cannot see go through
Engine.weights_updated(), which repacks every linear: that rebuilds the stack too, and its
derived fp32 constants (A, D, dt_bias, the final norm's weight) are computed again. The check is
C-level maps over the tensors' ids, addresses and versions: ~11 us a step with warm caches on the
bench shape (38 tensors, 8 packed linears; Zen 4, 1 thread). Qwen3-Next's stack also watches
its attention layers' KV caches (the step's layout: sleep / wake_up re-point them) and its MLPs'
packed linears and experts.

Where the model does not fit (a block that does not run as one call, `STACK` or
hybrid_kernels.FUSED off, layers that disagree on residual_in_fp32; for Qwen3-Next a layer or
MLP off its one call, fp32 attention layers, an MoE step of too many rows), `get` returns None,
the reason logged once, and the per-layer calls run.
"""
from __future__ import annotations

import logging
import operator
from typing import Optional

import torch

from cb_kernels.ops.mamba2_stack import Mamba2Stack, Mamba2StackLayer
from cb_kernels.ops.qwen3_next_stack import (Qwen3NextAttentionLayer, Qwen3NextDeltaNetLayer,
                                             Qwen3NextMlp, Qwen3NextStack)
from cb_kernels.runner import hybrid_kernels

logger = logging.getLogger("cb_kernels")

# False: the per-layer block calls run (tests and bench_hybrid_step.py compare the two).
STACK = True           # Mamba-2
QWEN3_NEXT_STACK = True

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")
_lin, _experts = operator.attrgetter("lin"), operator.attrgetter("experts")
_conv_state, _state = operator.attrgetter("conv_state"), operator.attrgetter("state")


def _versions(tensors: list) -> list:
    try:
        return list(map(_version, tensors))
    except RuntimeError:         # an inference tensor keeps no version counter
        return [0 if t.is_inference() else t._version for t in tensors]


class _StackRun:
    """What both runs share: the key of what the stack reads, its rebuild when that changed,
    the reason it does not run logged once. A subclass gives `sources` (a module's _parameters,
    a name), `_more(step)` (the other tensors it reads), `_objects()` (packed linears and
    experts), `why_not_now()`, `_build(step)` and `name`."""

    name = ""

    def __init__(self):
        self.stack = None
        self.key = None
        self.logged = None       # what was logged last: "" the stack runs, else why not

    def _key(self, step) -> tuple:
        params = [d[n] for d, n in self.sources]
        tensors = params + self._more(step)
        return (list(map(id, tensors)), list(map(id, self._objects())),
                list(map(_data_ptr, tensors)), _versions(params))

    def _switched_off(self) -> str:
        return ""

    def get(self, step=None):
        """The stack for this step (rebuilt when something it reads changed), or None."""
        off = self._switched_off()
        if off:
            return self._off(off)
        try:
            key = self._key(step)
        except (AttributeError, KeyError, TypeError, RuntimeError, IndexError) as e:
            return self._off(f"its tensors cannot be read ({e})")
        if key == self.key:      # the stack, or None for the reason logged, still holds
            return self.stack
        # why_not_now reads the switches (_switched_off) and the key's objects alone, so a
        # reason holds while the key does: fp32 Qwen3-Next checks its layers once, not a step
        self.stack, self.key = None, key
        reason = self.why_not_now()
        if reason:
            return self._off(reason)
        self._forget_derived()
        try:
            self.stack = self._build(step)
        except (TypeError, ValueError) as e:
            return self._off(str(e))
        if self.logged != "":
            logger.info("hybrid forward: %d %s layers and the final norm as one call (ops.%s)",
                        len(self.layers), self.name, type(self.stack).__name__)
            self.logged = ""
        return self.stack

    def _forget_derived(self) -> None:
        """Drop the derived fp32 constants so the build computes them again."""

    def _off(self, reason: str) -> None:
        if reason != self.logged:
            logger.info("hybrid forward: %s layers one call each (%s)", self.name, reason)
            self.logged = reason
        return None


class Mamba2StackRun(_StackRun):
    """Callable (input_ids, logits_indices, VarlenRows) -> [num_sampled, hidden] rows after the
    final norm, or None where the stack does not run this step (the caller runs the layers)."""

    name = "Mamba-2"

    def __init__(self, layers: list, embed, final_norm, final_w32, dtype):
        """layers: hybrid_layers._Mamba2Layer; embed: the nn.Embedding; final_norm: its
        _PlainNorm; final_w32: the final norm's weight in fp32 (hybrid_kernels._Derived)."""
        super().__init__()
        self.layers, self.embed, self.final_norm = layers, embed, final_norm
        self.final_w32, self.dtype = final_w32, dtype
        # (a module's _parameters, a name): looked up each step, so a replaced Parameter shows.
        self.sources = [(embed._parameters, "weight"), (final_norm.module._parameters, "weight")]
        for layer in layers:
            m = layer.kernel.module
            self.sources += [(layer.norm.module._parameters, "weight"),
                             (m.conv1d._parameters, "weight"), (m._parameters, "A_log"),
                             (m._parameters, "D"), (m._parameters, "dt_bias"),
                             (m.norm._parameters, "weight")]
            if m.conv1d._parameters.get("bias") is not None:
                self.sources.append((m.conv1d._parameters, "bias"))

    def _more(self, step) -> list:
        return [t for layer in self.layers for t in (layer.kernel.conv_state, layer.kernel.state)]

    def _objects(self) -> list:
        return [g.lin for layer in self.layers for g in (layer.in_group, layer.out_group)]

    def _switched_off(self) -> str:
        if not STACK or not hybrid_kernels.FUSED:
            return "hybrid_stack.STACK or hybrid_kernels.FUSED is off"
        return ""

    def why_not_now(self) -> str:
        """"" when the stack can run the layers as they are now, else why not."""
        if not STACK:
            return "hybrid_stack.STACK is off"
        if not all(layer.block_linears() is not None for layer in self.layers):
            return "a block does not run as one call (hybrid_kernels.FUSED, why_not_fused)"
        if len({layer.residual_in_fp32 for layer in self.layers}) != 1:
            return "the layers disagree on residual_in_fp32"
        return ""

    def _forget_derived(self) -> None:
        for layer in self.layers:
            layer.kernel.consts.key = None
        self.final_w32.key = None

    def _build(self, step) -> Optional[Mamba2Stack]:
        layers = []
        for layer in self.layers:
            k, m = layer.kernel, layer.kernel.module
            lin_in, lin_out = layer.block_linears()
            neg_a, d, dt_bias = k.consts.get()
            layers.append(Mamba2StackLayer(
                layer.norm.module.weight, layer.norm.eps, lin_in, lin_out,
                m.conv1d.weight.squeeze(1), m.conv1d.bias, k.conv_state, k.state, neg_a, d,
                dt_bias, m.norm.weight, m.norm.variance_epsilon, m.num_heads, m.head_dim,
                m.n_groups, m.ssm_state_size, hybrid_kernels._norm_group(m.norm)))
        fp32 = self.layers[0].residual_in_fp32 or self.dtype == torch.float32
        final_w = self.final_w32.get() if fp32 else self.final_norm.module.weight
        return Mamba2Stack(self.embed.weight, layers, final_w, self.final_norm.eps,
                           residual_fp32=fp32)

    def __call__(self, input_ids, logits_indices, rows) -> Optional[torch.Tensor]:
        stack = self.get()
        if stack is None:
            return None
        return stack.run_unchecked(input_ids, logits_indices, rows.slots, rows.cu_seqlens,
                                   rows.has_state)


def _weight(norm) -> torch.Tensor:
    """A hybrid_layers._OffsetNorm's weight as the per-layer calls pass it (contiguous)."""
    w = norm.module._parameters["weight"]
    return w if w.is_contiguous() else w.contiguous()


class Qwen3NextStackRun(_StackRun):
    """Callable (input_ids, positions, logits_indices, VarlenRows, AttentionMetadata) ->
    [num_sampled, hidden] rows after the final norm, or None where the stack does not run this
    step (the caller runs the layers)."""

    name = "Qwen3-Next"

    def __init__(self, layers: list, embed, final_norm, rotary, dtype):
        """layers: hybrid_layers._Qwen3NextLayer; embed: the nn.Embedding; final_norm: its
        _OffsetNorm; rotary: the forward's rotary table (fused.forward._RotaryTable)."""
        super().__init__()
        self.layers, self.embed, self.final_norm = layers, embed, final_norm
        self.rotary, self.dtype = rotary, dtype
        self.probe = torch.empty(1, 1, dtype=dtype)      # the rotary table reads its dtype
        self.sources = [(embed._parameters, "weight"), (final_norm.module._parameters, "weight")]
        for layer in layers:
            norms = [layer.in_norm, layer.post_norm]
            if not layer.linear:
                norms += [layer.q_norm, layer.k_norm]
            self.sources += [(n.module._parameters, "weight") for n in norms]
            if layer.linear:
                m = layer.kernel.module
                self.sources += [(m.conv1d._parameters, "weight"), (m._parameters, "A_log"),
                                 (m._parameters, "dt_bias"), (m.norm._parameters, "weight")]
                if m.conv1d._parameters.get("bias") is not None:
                    self.sources.append((m.conv1d._parameters, "bias"))
        # MoE layers' one moe_block call holds on steps of fewer rows (hybrid_layers.mlp)
        # What `_more` and `_objects` read, flat. The key of the bench's hd128 model (24
        # parameters, 8 slot / cache tensors, 31 packed objects): ~9 us in a loop, ~45 us in
        # a decode step whose kernels left the caches cold (Zen 4, 1 thread).
        self.kernels = [l.kernel for l in layers if l.linear]
        self.attention_idx = [l.idx for l in layers if not l.linear]
        self.lin_groups, self.experts_groups = [], []
        for l in layers:
            self.lin_groups += l.groups if l.linear else [l.qkv, l.o]
            self.lin_groups += [l.gate_up, l.down] + ([l.shared_gate] if l.moe else [])
            # a router or experts off our packed ops: mlp_parts() is None, the stack never runs
            if l.moe and l.router is not None and l.experts is not None:
                self.lin_groups.append(l.router)
                self.experts_groups.append(l.experts)
        self.max_rows = min((l.block_rows for l in layers if l.moe), default=None)
        self.logged_rows = False
        from cb_kernels.runner import hybrid_layers, moe_layers   # they import this module
        self.switches = (hybrid_layers, moe_layers)      # modules whose switches it reads

    def _more(self, step) -> list:
        k, v = step.layout.k_caches, step.layout.v_caches
        return [*map(_conv_state, self.kernels), *map(_state, self.kernels),
                *(k[i] for i in self.attention_idx), *(v[i] for i in self.attention_idx)]

    def _objects(self) -> list:
        return [*map(_lin, self.lin_groups), *map(_experts, self.experts_groups)]

    def _switched_off(self) -> str:
        hybrid_layers, moe_layers = self.switches
        if not (QWEN3_NEXT_STACK and hybrid_kernels.FUSED and hybrid_layers.FUSED_ATTENTION and
                moe_layers.BLOCK):
            return ("hybrid_stack.QWEN3_NEXT_STACK, hybrid_kernels.FUSED, "
                    "hybrid_layers.FUSED_ATTENTION or moe_layers.BLOCK is off")
        return ""

    def why_not_now(self) -> str:
        """"" when the stack can run the layers as they are now, else why not."""
        if any(l.block_linears() is None for l in self.layers if l.linear):
            return "a gated delta-net layer does not run as one call (why_not_fused)"
        if any(l.attention_linears() is None for l in self.layers if not l.linear):
            return "an attention layer does not run as one call (why_not_fused)"
        if self.dtype != torch.bfloat16 and not all(l.linear for l in self.layers):
            return "float32 attention layers run as two calls around torch's sigmoid"
        if any(l.mlp_parts() is None for l in self.layers):
            return "an MLP does not run as one ops.moe_block call (block_fits)"
        return ""

    def _forget_derived(self) -> None:
        for layer in self.layers:
            if layer.linear:
                layer.kernel.neg_a.key = None

    def _build(self, step) -> Qwen3NextStack:
        layers = []
        for layer in self.layers:
            gate_up, down, gate, router, experts = layer.mlp_parts()
            mlp = Qwen3NextMlp(gate_up, down, gate, router, layer.gate.top_k if layer.moe else 0,
                               bool(layer.gate.norm_topk_prob) if layer.moe else True, experts)
            norms = (_weight(layer.in_norm), _weight(layer.post_norm))
            if layer.linear:
                k, m = layer.kernel, layer.kernel.module
                layers.append(Qwen3NextDeltaNetLayer(
                    *norms, (layer.in_norm.eps, layer.post_norm.eps, m.norm.variance_epsilon),
                    *layer.block_linears(), m.conv1d.weight.squeeze(1), m.conv1d.bias,
                    k.conv_state, k.state, m.dt_bias, k.neg_a.get(), m.norm.weight,
                    m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, k.scale, mlp))
                continue
            eps = tuple(n.eps for n in (layer.in_norm, layer.post_norm, layer.q_norm,
                                        layer.k_norm))
            layers.append(Qwen3NextAttentionLayer(
                *norms, _weight(layer.q_norm), _weight(layer.k_norm), eps,
                *layer.attention_linears(), step.layout.k_caches[layer.idx],
                step.layout.v_caches[layer.idx], layer.num_heads, layer.scaling, mlp))
        rotary_dim = self.rotary(self.probe, torch.zeros(1, dtype=torch.int64))[0].shape[-1]
        return Qwen3NextStack(self.embed.weight, layers, _weight(self.final_norm),
                              self.final_norm.eps, rotary_dim=rotary_dim)

    def __call__(self, input_ids, positions, logits_indices, rows, step
                 ) -> Optional[torch.Tensor]:
        if self.max_rows is not None and input_ids.shape[0] >= self.max_rows:
            if not self.logged_rows:     # once: prefill and decode steps alternate
                logger.info("hybrid forward: Qwen3-Next steps of %d rows or more run the layers "
                            "one call each (their MoE blocks' sigmoid gate is torch's vectorised "
                            "one there)", self.max_rows)
                self.logged_rows = True
            return None
        stack = self.get(step)
        if stack is None:
            return None
        cos, sin = self.rotary(self.probe, positions)
        return stack.run_unchecked(input_ids, logits_indices, rows.slots, rows.cu_seqlens,
                                   rows.has_state, cos, sin, step.slot_mapping,
                                   step.block_tables, step.seq_lens, step.cu_seqlens_q)
