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

Where the layers have one shape (no q/k norms: Llama, Qwen2, Mistral) and every projection is on
our packed kernel, the whole stack runs in one C++ call (ops.FusedDecoder, csrc/cpu/fused_decoder.cpp):
the same kernels in the same order, the same bits, without this loop's nine Python calls a layer
(a bf16 SmolLM2 decode step on the 2-core Zen 4, interleaved A/B steps in one run: 16 requests
16.2 -> 14.1 ms, 64 requests 43.0 -> 39.7 ms). `NATIVE = False` keeps the loop (tests compare
the two).

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


class _RotaryTable:
    """The rotary module's cos/sin for positions 0..n-1, computed once by the module itself and
    read per step with one index_select: its elementwise formula gives each position the same
    values whatever else the call holds (checked on a probe at build), and the per-step call
    cost 60 us unloaded (its cos ran as the step's first parallel region: 2 ms with a core
    busy elsewhere). Rotary types whose frequencies follow the sequence length ("dynamic",
    "longrope") call the module every step; so does a change of its inv_freq."""

    def __init__(self, rotary):
        self.rotary = rotary
        self.key, self.cos, self.sin = None, None, None
        self.num_builds = 0         # tables computed (the engine's warm-up test counts them)
        rope_type = str(getattr(rotary, "rope_type", "default"))
        self.cached = "dynamic" not in rope_type and rope_type != "longrope" and \
            isinstance(getattr(rotary, "inv_freq", None), torch.Tensor) and self._probe()

    def _direct(self, x, positions):
        cos, sin = self.rotary(x, positions[None])
        return cos[0].contiguous(), sin[0].contiguous()

    def _probe(self) -> bool:
        x = torch.zeros(1, 1, 1, dtype=self.rotary.inv_freq.dtype)
        positions = torch.tensor([5, 0, 17, 1000, 3, 64])
        try:
            with torch.inference_mode():
                want = self._direct(x, positions)
                got = self(x, positions)
        except Exception:       # a rotary module of another signature: call it every step
            return False
        finally:
            self.key = None
        return all(torch.equal(a, b) for a, b in zip(got, want))

    def forget(self) -> int:
        """Drop the cos/sin tables (Engine.sleep(level=2)); returns their bytes."""
        freed = sum(t.numel() * t.element_size() for t in (self.cos, self.sin) if t is not None)
        self.key, self.cos, self.sin = None, None, None
        return freed

    def __call__(self, x, positions):
        """x: anything of the step's dtype; positions int64 [T]. Returns cos, sin [T, head_dim]."""
        if not getattr(self, "cached", True):
            return self._direct(x, positions)
        f = self.rotary.inv_freq
        need = int(positions.max()) + 1 if positions.numel() else 1
        key = (f.data_ptr(), 0 if f.is_inference() else f._version,
               getattr(self.rotary, "attention_scaling", None), x.dtype)
        if key != self.key or need > self.cos.shape[0]:
            # 4096 positions from the start (1 MiB in bf16 at head_dim 64): prompts up to that
            # never rebuild it inside a user's step.
            n = max(4096, 1 << (need - 1).bit_length())
            self.cos, self.sin = self._direct(x[..., :1], torch.arange(n))
            self.key = key
            self.num_builds += 1
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


# False: the Python loop of FusedForward.__call__ even where FusedDecoder could run it (tests
# compare the two).
NATIVE = True


def _native_decoder(layers: list, final_norm: _Norm, dtype) -> Optional[ops.FusedDecoder]:
    """A FusedDecoder for these layers when they fit its one shape: no q/k norms, no
    tensor-parallel split, one eps and one scale throughout, gate and up of equal width."""
    first = layers[0]
    norms = [final_norm] + [n for layer in layers for n in (layer.in_norm, layer.post_norm)]
    # (a tensor-parallel split, `layer.tp`, all-reduces between the passes: the loop does it)
    if any(layer.q_norm is not None or getattr(layer, "tp", None) is not None
           for layer in layers) or \
            len({n.eps for n in norms}) != 1 or len({layer.scaling for layer in layers}) != 1 or \
            any((layer.num_heads, layer.num_kv_heads, layer.head_dim, sum(layer.gate_up.splits))
                != (first.num_heads, first.num_kv_heads, first.head_dim, sum(first.gate_up.splits))
                for layer in layers):
        return None
    try:
        return ops.FusedDecoder(
            hidden=final_norm.module.weight.shape[0], heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            intermediate=sum(first.gate_up.splits) // 2, eps=final_norm.eps, scale=float(first.scaling),
            dtype=dtype)
    except (TypeError, ValueError):
        return None


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
        # A tensor-parallel split (runner/tensor_parallel/sharding.py): o_proj's and down_proj's
        # partial sums are added over the ranks here, as their hooks would on transformers' path.
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
        self.native = _native_decoder(layers, final_norm, decoder.embed_tokens.weight.dtype)
        self._table_key: list = []      # the objects the table's addresses come from
        self.rotary = _RotaryTable(decoder.rotary_emb)
        self._table: list = []
        self.num_table_builds = 0       # layer tables built (the warm-up test counts them)

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

    def workspace_bytes(self, num_tokens: int) -> int:
        """Scratch bytes (ops/workspace.py) of a step of num_tokens rows: FusedDecoder's, where
        it runs; 0 otherwise."""
        return self.native.workspace_bytes(num_tokens) if self.native is not None and NATIVE \
            else 0

    def usable(self) -> bool:
        """False once someone added a forward hook or an instance forward (this path would skip
        it)."""
        return not has_hooks(self.modules)

    def _native_table(self, step) -> Optional[list]:
        """FusedDecoder's layer table for this step, or None when a projection is not on our
        packed kernel now (packed_linears.GEMM, or a weight that stopped qualifying)."""
        key = [step.layout.k_caches, step.layout.v_caches]
        for layer in self.layers:
            for g in (layer.qkv, layer.gate_up, layer.o, layer.down):
                if g.lin is None:
                    return None
                key.append(g.lin)
            key += [layer.in_norm.module._parameters["weight"],
                    layer.post_norm.module._parameters["weight"]]
        # `is`, not ids: the key holds the objects, so an address cannot be reused under it
        if len(key) != len(self._table_key) or any(a is not b for a, b in zip(key, self._table_key)):
            self._table = self.native.layer_table(
                [(layer.in_norm.module.weight, layer.post_norm.module.weight, layer.qkv.lin,
                  layer.o.lin, layer.gate_up.lin, layer.down.lin, layer.window)
                 for layer in self.layers], step.layout.k_caches, step.layout.v_caches)
            self._table_key = key
            self.num_table_builds += 1
        return self._table

    def forget_table(self) -> int:
        """Drop FusedDecoder's layer table (it holds the addresses of the pool and the packed
        weights, which sleep frees); the next step builds it again. Returns its bytes."""
        freed = sum(t.numel() * t.element_size() for t in self._table
                    if isinstance(t, torch.Tensor))
        self._table, self._table_key = [], []
        return freed

    @torch.inference_mode()
    def __call__(self, input_ids, positions, logits_indices, step) -> torch.Tensor:
        d = self.decoder
        x = d.embed_tokens(input_ids[None])                  # [1, T, hidden]
        cos, sin = self.rotary(x, positions)                 # [T, head_dim]
        x = x[0].contiguous()     # a fresh tensor: the fused norms add the residuals into it
        num_tokens = x.shape[0]
        backend = step.layout.backend or "cpu"
        table = self._native_table(step) if self.native is not None and backend == "cpu" \
            and NATIVE else None
        if table is not None:     # the same passes below in one C++ call (ops/fused_decoder.py)
            rows = self.native(x, cos, sin, table, self.final_norm.module.weight,
                               step.slot_mapping, step.block_tables, step.seq_lens,
                               step.cu_seqlens_q, step.layout.k_caches[0],
                               step.layout.v_caches[0])
            return rows.index_select(0, logits_indices)
        pending = None     # the last sublayer's output, added into x by the next norm
        for i, layer in enumerate(self.layers):
            h = layer.in_norm.fused(x, pending)
            q, k, v = layer.qkv.run(h).split(layer.splits, dim=-1)
            q = q.view(num_tokens, layer.num_heads, layer.head_dim)
            k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            k_cache, v_cache = step.layout.k_caches[i], step.layout.v_caches[i]
            # rope_(q), rope_(k), write_kv in one pass; layer 0 checks the shapes all layers share
            ops.rope_write_kv_unchecked(q, k, v, cos, sin, k_cache, v_cache, step.slot_mapping,
                                        check_metadata=i == 0)
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
