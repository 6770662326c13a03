"""The engine's own forward for the Llama family (llama, mistral, qwen2, qwen3) on CPU fp32.

Why: with the linears packed (packed_linears.py), what remains of a decode step beyond the
GEMMs is transformers' per-layer Python: module calls, kwarg decorators, views and transposes,
an 8-op RMSNorm, 16 ops of rotary, the checks of our attention op on every layer. Measured on
SmolLM2-135M (30 layers), 16 decode rows, 1 thread: 16 ms of an 81 ms forward outside the
linears. This path runs the same math in fewer passes: each RMSNorm with the residual add before
it as one C++ pass, SiLU(gate) * up as one, the rotary embedding in place as one (transformers'
formula, its own cos/sin module), the fused packed projections, and the attention kernels called
directly after one check of the step's metadata on layer 0. Logits agree with transformers'
forward to fp32 rounding (other summation order, fused multiply-adds), tested per family; the
greedy tokens of the engine tests are transformers' generate's.

It applies only when the model is exactly what it expects: a known model type whose modules (the
model, decoder, layers, attention, MLP, norms) are that family's own transformers classes, not
subclasses (which may override forward: a silent divergence otherwise), RMSNorms and activation
that probe equal to `F.rms_norm`/`F.silu`, the q/k/v and gate/up projections packed as groups,
and no forward hooks or instance `forward`s anywhere (a monkeypatch or an accelerate hook would be
skipped; the packed linears' own are fine). Anything else keeps transformers' forward (with packed
linears); `build` says None.

On an all-greedy step the engine asks for tokens, not logits (`run(..., greedy=True)`): with the
greedy head on (EngineConfig.greedy_head, ops/greedy_head.py) the head's argmax comes from int8
scores and exact rescoring instead of every fp32 logit.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import _C, ops
from cb_kernels.ops.elementwise import rope_, silu_mul
from cb_kernels.ops.greedy_head import GreedyHead
from cb_kernels.hf.packed_linears import is_packed_forward
from cb_kernels.ops.cache_ops import write_kv_unchecked
from cb_kernels.ops.paged_attention import paged_attention_unchecked

logger = logging.getLogger("cb_kernels")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class _Norm:
    """An RMSNorm module run as F.rms_norm (its weight read at each call: it may be replaced)."""

    def __init__(self, module, eps: float):
        self.module, self.eps = module, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        return F.rms_norm(x, (w.shape[0],), w, self.eps)

    def fused(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """x: contiguous [T, dim], updated in place to x + residual (when given); returns the
        norm of that. One C++ pass (ops/elementwise.py) instead of torch's add and six ops."""
        w = self.module.weight
        rows, dim = x.shape
        out = torch.empty_like(x)
        _C.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), w.data_ptr(),
                    out.data_ptr(), rows, dim, dim, dim, dim, self.eps)
        return out


def _rms_norm(norm) -> Optional[_Norm]:
    """`norm` as a _Norm when it computes exactly F.rms_norm(x, weight, eps), else None."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) \
            or w.dim() != 1 or w.dtype != torch.float32 or not isinstance(eps, float):
        return None
    probe = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not torch.equal(norm(probe), F.rms_norm(probe, (w.shape[0],), w, eps)):
            return None
    return _Norm(norm, eps)


def _greedy_head_ok(head) -> bool:
    return getattr(head, "bias", None) is None and GreedyHead.accepts(getattr(head, "weight", None))


def _is_silu(act) -> bool:
    probe = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    with torch.no_grad():
        return callable(act) and torch.equal(act(probe), F.silu(probe))


def _has_hooks(modules: list) -> bool:
    """A forward hook, or an instance `forward` not installed by PackedLinears (another engine's
    step may be running on the model in another thread), on any of `modules`. Reads each
    module's __dict__: 37 us a step for the 397 modules of a 30-layer Llama (SmolLM2-135M's
    layout) on the dev box, 33 us for the hooks alone."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    try:
        for m in modules:
            d = m.__dict__
            if d["_forward_hooks"] or d["_forward_pre_hooks"]:
                return True
            forward = d.get("forward")
            if forward is not None and not is_packed_forward(forward):
                return True
    except KeyError:            # a module without hook dicts: not one this path knows
        return True
    return False


def _own_classes(model, decoder, model_type: str) -> bool:
    """Every module this path re-implements is of the family's transformers modeling module."""
    home = f"transformers.models.{model_type}.modeling_{model_type}"
    mods = [model, decoder, decoder.norm]
    for layer in decoder.layers:
        attn = layer.self_attn
        mods += [layer, attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        mods += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    return all(type(m).__module__ == home for m in mods)


class _Layer:
    def __init__(self, layer, groups, model_type, adapter):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm = _rms_norm(layer.input_layernorm)
        self.post_norm = _rms_norm(layer.post_attention_layernorm)
        self.qkv = groups.get(id(attn.q_proj))
        self.o = groups.get(id(attn.o_proj))
        self.gate_up = groups.get(id(mlp.gate_proj))
        self.down = groups.get(id(mlp.down_proj))
        self.q_norm = self.k_norm = None
        if model_type == "qwen3":
            self.q_norm = _rms_norm(getattr(attn, "q_norm", None))
            self.k_norm = _rms_norm(getattr(attn, "k_norm", None))
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        if model_type == "mistral":
            self.window = getattr(attn.config, "sliding_window", None)
        elif model_type in ("qwen2", "qwen3"):
            self.window = getattr(attn, "sliding_window", None)
        else:
            self.window = None
        self.num_heads, self.num_kv_heads = adapter.num_heads, adapter.num_kv_heads
        self.ok = (self.in_norm is not None and self.post_norm is not None
                   and self.qkv is not None and [m for m in self.qkv.members]
                   == [attn.q_proj, attn.k_proj, attn.v_proj]
                   and self.gate_up is not None and self.gate_up.members == [mlp.gate_proj,
                                                                             mlp.up_proj]
                   and self.o is not None and self.down is not None and _is_silu(mlp.act_fn)
                   and (model_type != "qwen3" or (self.q_norm is not None
                                                  and self.k_norm is not None))
                   and attn.q_proj.out_features == self.num_heads * self.head_dim
                   and attn.k_proj.out_features == self.num_kv_heads * self.head_dim)


class LlamaFastPath:
    """Callable like the adapter's model run: (input_ids [1, T], position_ids [1, T],
    logits_indices [S], step) -> logits [S, vocab_size]."""

    def __init__(self, model, decoder, layers: list, head, packed):
        self.model, self.decoder, self.layers, self.head, self.packed = \
            model, decoder, layers, head, packed
        self.final_norm = _rms_norm(decoder.norm)
        self.modules = list(model.modules())
        self.head_module = head.members[0] if head is not None else None
        self.greedy: Optional[GreedyHead] = None    # see enable_greedy_head()

    @classmethod
    def build(cls, model, packed, adapter) -> Optional["LlamaFastPath"]:
        model_type = getattr(model.config, "model_type", None)
        if packed is None or model_type not in FAMILIES or _has_hooks(list(model.modules())):
            return None
        decoder = getattr(model, "model", None)
        names = ("embed_tokens", "layers", "norm", "rotary_emb")
        if decoder is None or any(not hasattr(decoder, n) for n in names) \
                or len(decoder.layers) != adapter.num_layers:
            return None
        groups = {id(g.members[0]): g for g in packed.groups}
        head = groups.get(id(getattr(model, "lm_head", None)))
        try:
            if not _own_classes(model, decoder, model_type):
                return None
            layers = [_Layer(layer, groups, model_type, adapter) for layer in decoder.layers]
        except AttributeError:       # a layer without the attributes of this family
            return None
        path = cls(model, decoder, layers, head, packed)
        if head is None or path.final_norm is None or not all(layer.ok for layer in layers):
            return None
        return path

    def enable_greedy_head(self, mode="auto") -> bool:
        """Builds the greedy head (its int8 copy of the head weight) when `mode` is True, or
        "auto" and the CPU has VNNI; not for a head with a bias or a weight the kernel cannot
        read. Returns whether it is on."""
        self.greedy = None
        if mode is False or (mode == "auto" and not GreedyHead.fast()):
            return False
        if not _greedy_head_ok(self.head_module):
            logger.info("greedy_head: off (the LM head has a bias or is not a plain fp32 weight)")
            return False
        try:
            self.greedy = GreedyHead(self.head_module.weight)
        except RuntimeError as e:            # a non-finite weight
            logger.warning("greedy_head: off (%s)", e)
            return False
        logger.info("greedy_head: on (%.1f MiB int8 copy of the LM head)",
                    self.greedy.packed.numel() / 2**20)
        return True

    def _greedy_tokens(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """The greedy head's tokens for `rows`, or None to take the fp32 head (a non-finite hidden
        state: torch's argmax rule for NaN applies there)."""
        g, m = self.greedy, self.head_module
        # The user replaced the parameter, swapped its .data for another shape or dtype, or gave
        # the head a bias: build again (or turn off).
        if (g.weight is not m.weight or not _greedy_head_ok(m)
                or tuple(m.weight.shape) != (g.vocab, g.hidden)):
            self.enable_greedy_head(True)
            if self.greedy is None:
                return None
            g = self.greedy
        try:
            return g(rows)
        except RuntimeError:
            return None

    def usable(self) -> bool:
        """False once someone added a forward hook or an instance forward (this path would skip
        it)."""
        return not _has_hooks(self.modules)

    def __call__(self, input_ids, position_ids, logits_indices, step) -> torch.Tensor:
        return self.run(input_ids, position_ids, logits_indices, step)[0]

    @torch.inference_mode()
    def run(self, input_ids, position_ids, logits_indices, step, greedy: bool = False):
        """(logits [S, vocab], None), or with `greedy` and the greedy head on, (None, the argmax
        token ids int64 [S])."""
        self.packed.refresh()
        d = self.decoder
        x = d.embed_tokens(input_ids)                        # [1, T, hidden]
        cos, sin = d.rotary_emb(x, position_ids)             # [1, T, head_dim]
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, head_dim]
        x = x[0].contiguous()     # a fresh tensor: the fused norms add the residuals into it
        num_tokens = x.shape[0]
        backend = step.backend or "cpu"
        pending = None     # the last sublayer's output, added into x by the next norm
        for i, layer in enumerate(self.layers):
            h = layer.in_norm.fused(x, pending)
            qkv = layer.qkv.run(h)
            q, k, v = qkv.split(layer.qkv.splits, dim=-1)
            q = q.view(num_tokens, layer.num_heads, layer.head_dim)
            k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            rope_(q, cos, sin)
            rope_(k, cos, sin)
            k_cache, v_cache = step.k_caches[i], step.v_caches[i]
            write_kv_unchecked(k, v, k_cache, v_cache, step.slot_mapping)
            if i == 0:      # one full check of the step's metadata; the other layers share it
                out = ops.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                                          step.cu_seqlens_q, scale=layer.scaling,
                                          sliding_window=layer.window, backend=backend)
            else:
                out = paged_attention_unchecked(
                    q, k_cache, v_cache, step.block_tables, step.seq_lens, step.cu_seqlens_q,
                    torch.empty_like(q), scale=layer.scaling, sliding_window=layer.window,
                    backend=backend)
            h = layer.post_norm.fused(x, layer.o.run(out.view(num_tokens, -1)))
            pending = layer.down.run(silu_mul(layer.gate_up.run(h)))
        x = self.final_norm.fused(x, pending)
        rows = x.index_select(0, logits_indices)
        if greedy and self.greedy is not None:
            tokens = self._greedy_tokens(rows)
            if tokens is not None:
                return None, tokens
        return self.head.run(rows), None
