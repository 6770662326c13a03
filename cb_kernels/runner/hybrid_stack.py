"""The engine's Mamba-2 forward as one C++ call a step (ops.Mamba2Stack), for
runner/hybrid_layers.py.

Why: with each Mamba-2 block one C++ call, the Python around them (the embedding, the fp32 cast,
a wrapper a layer, the final norm, its cast, the row selection) is serial at any thread count.
Here the layers' tensors are resolved into one ops.Mamba2Stack, kept while nothing it reads
changed, and a step is one call: the forward's glue of a 16-row bf16 decode step on the bench's
ds128 shape from 0.32-0.40 to 0.18-0.23 ms, the step 3-9% shorter at 1 and 2 threads
(bench_hybrid_step.py --blocks, Zen 4, load ~2).

What "changed" means: a parameter the stack reads replaced or re-pointed (its object, address)
or written through torch (its version counter), a packed linear repacked (runner/packed_linears
makes a new PackedLinear: the runner refreshes them before the step), a state slot tensor moved
(sleep / wake_up re-point the pool). Writes torch cannot see go through
Engine.weights_updated(), which repacks every linear: that rebuilds the stack too, and its
derived fp32 constants (A, D, dt_bias, the final norm's weight) are computed again. The check is
C-level maps over the tensors' ids, addresses and versions: ~11 us a step with warm caches on the
bench shape (38 tensors, 8 packed linears; Zen 4, 1 thread).

Where the model does not fit (a block that does not run as one call, `STACK` or
hybrid_kernels.FUSED off, layers that disagree on residual_in_fp32), `get` returns None, the
reason logged once, and the per-layer calls run.
"""
from __future__ import annotations

import logging
import operator
from typing import Optional

import torch

from cb_kernels.ops.mamba2_stack import Mamba2Stack, Mamba2StackLayer
from cb_kernels.runner import hybrid_kernels

logger = logging.getLogger("cb_kernels")

# False: the per-layer block calls run (tests and bench_hybrid_step.py compare the two).
STACK = True

_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")


def _versions(tensors: list) -> list:
    try:
        return list(map(_version, tensors))
    except RuntimeError:         # an inference tensor keeps no version counter
        return [0 if t.is_inference() else t._version for t in tensors]


class Mamba2StackRun:
    """Callable (input_ids, logits_indices, VarlenRows) -> [num_sampled, hidden] rows after the
    final norm, or None where the stack does not run this step (the caller runs the layers)."""

    def __init__(self, layers: list, embed, final_norm, final_w32, dtype):
        """layers: hybrid_layers._Mamba2Layer; embed: the nn.Embedding; final_norm: its
        _PlainNorm; final_w32: the final norm's weight in fp32 (hybrid_kernels._Derived)."""
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
        self.stack: Optional[Mamba2Stack] = None
        self.key = None
        self.logged = None       # what was logged last: "" the stack runs, else why not

    def _watched(self) -> list:
        """Every tensor and packed linear the stack reads, as they are now."""
        tensors = [d[n] for d, n in self.sources]
        for layer in self.layers:
            tensors += [layer.kernel.conv_state, layer.kernel.state]
        return tensors

    def _key(self) -> tuple:
        tensors = self._watched()
        lins = [g.lin for layer in self.layers for g in (layer.in_group, layer.out_group)]
        params = tensors[:len(self.sources)]
        return (list(map(id, tensors)), list(map(id, lins)), list(map(_data_ptr, tensors)),
                _versions(params))

    def why_not_now(self) -> str:
        """"" when the stack can run the layers as they are now, else why not."""
        if not STACK:
            return "hybrid_stack.STACK is off"
        if not all(layer.block_linears() is not None for layer in self.layers):
            return "a block does not run as one call (hybrid_kernels.FUSED, why_not_fused)"
        if len({layer.residual_in_fp32 for layer in self.layers}) != 1:
            return "the layers disagree on residual_in_fp32"
        return ""

    def _build(self) -> Optional[Mamba2Stack]:
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

    def get(self) -> Optional[Mamba2Stack]:
        """The stack for this step (rebuilt when something it reads changed), or None."""
        if not STACK or not hybrid_kernels.FUSED:
            return self._off("hybrid_stack.STACK or hybrid_kernels.FUSED is off")
        try:
            key = self._key()
        except (AttributeError, KeyError, TypeError, RuntimeError) as e:
            return self._off(f"its tensors cannot be read ({e})")
        if self.stack is not None and key == self.key:
            return self.stack
        self.stack, self.key = None, None
        reason = self.why_not_now()
        if reason:
            return self._off(reason)
        for layer in self.layers:        # the derived fp32 constants, computed again
            layer.kernel.consts.key = None
        self.final_w32.key = None
        try:
            self.stack = self._build()
        except (TypeError, ValueError) as e:
            return self._off(str(e))
        self.key = key
        if self.logged != "":
            logger.info("hybrid forward: %d Mamba-2 layers and the final norm as one call "
                        "(ops.Mamba2Stack)", len(self.layers))
            self.logged = ""
        return self.stack

    def _off(self, reason: str) -> None:
        if reason != self.logged:
            logger.info("hybrid forward: Mamba-2 layers one call each (%s)", reason)
            self.logged = reason
        return None

    def __call__(self, input_ids, logits_indices, rows) -> Optional[torch.Tensor]:
        stack = self.get()
        if stack is None:
            return None
        return stack.run_unchecked(input_ids, logits_indices, rows.slots, rows.cu_seqlens,
                                   rows.has_state)
