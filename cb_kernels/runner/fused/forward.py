"""The engine's own decoder forward on CPU, fp32 or bf16, for the families in families/ (a spec each).

Why: with the linears packed (runner/packed_linears.py), what remains of a decode step beyond the
GEMMs is transformers' per-layer Python: module calls, kwarg decorators, views and transposes,
an 8-op RMSNorm, 16 ops of rotary, the checks of our attention op on every layer. Measured on
SmolLM2-135M (30 layers), 16 decode rows, 1 thread: 16 ms of an 81 ms forward outside the
linears. This path runs the same math in fewer passes: each RMSNorm with the residual add before
it as one C++ pass, SiLU(gate) * up as one, the rotary embedding in place as one (transformers'
formula, its own cos/sin module), the fused packed projections, and the attention kernels called
directly after one check of the step's metadata on layer 0. Logits agree with transformers'
forward to fp32 rounding (other summation order, fused multiply-adds), tested per family; the
greedy tokens of the engine tests are transformers' generate's. In bf16 every tensor between
the passes is bf16 as in transformers' forward, and each pass rounds where transformers' op
chain rounds (ops/rms_norm.py and the others say where), so the two differ by the GEMMs' and
attention's summation order, not by a different formula.

It applies only when the model is exactly what its spec describes: the family's own transformers
classes, not subclasses (which may override forward: a silent divergence otherwise), RMSNorms and
activation that probe equal to `F.rms_norm`/`F.silu`, the projections packed, and no forward hooks
or instance `forward`s anywhere (a monkeypatch or an accelerate hook would be skipped; the packed
linears' own are fine). Anything else keeps transformers' forward; `build` says None. It ends at
the final norm: the runner's LM head (runner/lm_head.py) takes the rows from there.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.runner.fused.families import spec_for
from cb_kernels.runner.fused.spec import FamilySpec
from cb_kernels.runner.packed_linears import has_hooks
from cb_kernels.runner.tensor_parallel import all_reduce_, info_of


def _bf16_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm on a bf16 tensor: the norm in fp32, cast, times the weight."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _Norm:
    """An RMSNorm module run as F.rms_norm in fp32, as transformers' formula in bf16 (its weight
    read at each call: it may be replaced)."""

    def __init__(self, module, eps: float):
        self.module, self.eps = module, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        if w.dtype == torch.bfloat16:
            return _bf16_rms_norm(x, w, self.eps)
        return F.rms_norm(x, (w.shape[0],), w, self.eps)

    def fused(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """x: contiguous [T, dim], updated in place to x + residual (when given); returns the
        norm of that, in one C++ pass instead of torch's add and six ops."""
        return ops.rms_norm_unchecked(x, self.module.weight, self.eps, residual)


def _rms_norm(norm) -> Optional[_Norm]:
    """`norm` as a _Norm when it computes exactly F.rms_norm(x, weight, eps) (fp32), or exactly
    transformers' LlamaRMSNorm formula (bf16), else None."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) \
            or w.dim() != 1 or w.dtype not in (torch.float32, torch.bfloat16) \
            or not isinstance(eps, float):
        return None
    probe = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        if not torch.equal(norm(probe), _Norm(norm, eps)(probe)):
            return None
    return _Norm(norm, eps)


def _is_silu(act) -> bool:
    probe = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        return callable(act) and torch.equal(act(probe), F.silu(probe))


def _own_classes(spec: FamilySpec, model, decoder) -> bool:
    """Every module this path re-implements is of the family's transformers modeling module."""
    mods = [model, decoder, decoder.norm]
    for layer in decoder.layers:
        attn = getattr(layer, spec.attn)
        mods += [layer, attn, getattr(layer, spec.mlp), getattr(layer, spec.input_norm),
                 getattr(layer, spec.post_attention_norm)]
        if spec.qk_norm:
            mods += [attn.q_norm, attn.k_norm]
    return all(type(m).__module__ == spec.modeling_module for m in mods)


class _Layer:
    def __init__(self, spec: FamilySpec, layer, packed, num_heads: int, num_kv_heads: int):
        attn, mlp = getattr(layer, spec.attn), getattr(layer, spec.mlp)
        self.in_norm = _rms_norm(getattr(layer, spec.input_norm))
        self.post_norm = _rms_norm(getattr(layer, spec.post_attention_norm))
        qkv = [getattr(attn, n) for n in spec.qkv]
        gate_up = [getattr(mlp, n) for n in spec.gate_up]
        self.qkv, self.gate_up = packed.group_of(qkv[0]), packed.group_of(gate_up[0])
        self.o = packed.group_of(getattr(attn, spec.o_proj))
        self.down = packed.group_of(getattr(mlp, spec.down_proj))
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm, self.k_norm = _rms_norm(attn.q_norm), _rms_norm(attn.k_norm)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        # A tensor-parallel split (runner/tensor_parallel.py): o_proj's and down_proj's partial
        # sums are added over the ranks here, as their hooks would on transformers' path.
        self.tp = info_of(getattr(attn, spec.o_proj))
        self.window = spec.sliding_window(attn)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.splits = [q_size, kv_size, kv_size]
        self.ok = (self.in_norm is not None and self.post_norm is not None
                   and self.qkv is not None and self.qkv.members == qkv
                   and self.gate_up is not None and self.gate_up.members == gate_up
                   and self.o is not None and self.down is not None
                   and _is_silu(getattr(mlp, spec.act, None))
                   and (not spec.qk_norm or (self.q_norm is not None and self.k_norm is not None))
                   and sum(m.out_features for m in qkv) == sum(self.splits)
                   and qkv[0].out_features == (q_size if len(qkv) == 3 else sum(self.splits))
                   and sum(m.out_features for m in gate_up) % 2 == 0)


class FusedForward:
    """Callable (input_ids [T], positions [T], logits_indices [S], AttentionMetadata) -> the
    final-norm hidden rows [S, hidden] of the sampled tokens."""

    def __init__(self, model, decoder, layers: list, final_norm: _Norm):
        self.model, self.decoder, self.layers, self.final_norm = model, decoder, layers, final_norm
        self.modules = list(model.modules())

    @classmethod
    def build(cls, model, packed, num_layers: int, num_heads: int,
              num_kv_heads: int) -> Optional["FusedForward"]:
        spec = spec_for(getattr(model.config, "model_type", None))
        if packed is None or spec is None or has_hooks(list(model.modules())):
            return None
        decoder = getattr(model, "model", None)
        names = ("embed_tokens", "layers", "norm", "rotary_emb")
        if decoder is None or any(not hasattr(decoder, n) for n in names) \
                or len(decoder.layers) != num_layers:
            return None
        try:
            if not _own_classes(spec, model, decoder):
                return None
            layers = [_Layer(spec, layer, packed, num_heads, num_kv_heads)
                      for layer in decoder.layers]
        except AttributeError:       # a layer without the modules its spec names
            return None
        final_norm = _rms_norm(decoder.norm)
        if final_norm is None or not all(layer.ok for layer in layers):
            return None
        # One dtype through every pass: the kernels take all their tensors in x's dtype (a norm
        # kept in fp32 beside bf16 linears, `_keep_in_fp32_modules`, keeps transformers' path).
        dtype = decoder.embed_tokens.weight.dtype
        norms = [final_norm] + [n for layer in layers
                                for n in (layer.in_norm, layer.post_norm, layer.q_norm, layer.k_norm)
                                if n is not None]
        if any(n.module.weight.dtype != dtype for n in norms) or \
                any(g.dtype != dtype for layer in layers
                    for g in (layer.qkv, layer.gate_up, layer.o, layer.down)):
            return None
        return cls(model, decoder, layers, final_norm)

    def usable(self) -> bool:
        """False once someone added a forward hook or an instance forward (this path would skip
        it)."""
        return not has_hooks(self.modules)

    @torch.inference_mode()
    def __call__(self, input_ids, positions, logits_indices, step) -> torch.Tensor:
        d = self.decoder
        x = d.embed_tokens(input_ids[None])                  # [1, T, hidden]
        cos, sin = d.rotary_emb(x, positions[None])          # [1, T, head_dim]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, head_dim]
        x = x[0].contiguous()     # a fresh tensor: the fused norms add the residuals into it
        num_tokens = x.shape[0]
        backend = step.backend or "cpu"
        pending = None     # the last sublayer's output, added into x by the next norm
        for i, layer in enumerate(self.layers):
            h = layer.in_norm.fused(x, pending)
            q, k, v = layer.qkv.run(h).split(layer.splits, dim=-1)
            q = q.view(num_tokens, layer.num_heads, layer.head_dim)
            k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
            k_cache, v_cache = step.k_caches[i], step.v_caches[i]
            ops.write_kv_unchecked(k, v, k_cache, v_cache, step.slot_mapping)
            if i == 0:      # one full check of the step's metadata; the other layers share it
                out = ops.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                          step.cu_seqlens_q, scale=layer.scaling,
                                          sliding_window=layer.window, backend=backend)
            else:
                out = ops.paged_attention_unchecked(
                    q, k_cache, v_cache, step.block_tables, step.seq_lens, step.cu_seqlens_q,
                    torch.empty_like(q), scale=layer.scaling, sliding_window=layer.window,
                    backend=backend)
            o = layer.o.run(out.view(num_tokens, -1))
            if layer.tp is not None:
                all_reduce_(o, layer.tp)
            h = layer.post_norm.fused(x, o)
            pending = layer.down.run(ops.silu_mul(layer.gate_up.run(h)))
            if layer.tp is not None:
                all_reduce_(pending, layer.tp)
        x = self.final_norm.fused(x, pending)
        return x.index_select(0, logits_indices)
