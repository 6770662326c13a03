"""A Qwen3NextForCausalLM step's backbone in one C++ call: the embedding, every decoder layer
(its gated delta-net or gated attention up to the MLP: ``gated_delta_net_block`` /
``gated_attention_block``; then its MLP: ``moe_block``) and the final norm of the sampled rows
(csrc/cpu/qwen3_next_stack.cpp says why; cb_kernels/qwen3_next_stack.h what it computes).

``Qwen3NextStack(embed, layers, final_norm_weight, final_norm_eps, rotary_dim=...)`` checks and
holds the layers' tensors once; each call passes the step's token ids, sampled rows, varlen
rows, cos/sin and attention metadata, and updates every layer's state slots and KV caches in
place. The bits are those of the calls apart (runner/hybrid_layers.py's per-layer path:
tests/ops/test_qwen3_next_stack.py). CPU, bfloat16; float32 only without attention layers (the
fp32 gate's sigmoid is torch's, between two C++ calls: ops/gated_attention.py).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, check_tensor, sync_threads
from cb_kernels.ops import workspace
from cb_kernels.ops._stack import check_embed_and_layers, check_ids
from cb_kernels.ops._varlen import check_values as check_row_values
from cb_kernels.ops._varlen import check_varlen, rows_arg
from cb_kernels.ops.fused_hybrid import gated_delta_net
from cb_kernels.ops.gated_attention import _check as check_attention
from cb_kernels.ops.gated_attention import sigmoid_table
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.moe import PackedExperts
from cb_kernels.ops.moe_block import moe_block


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


class Qwen3NextMlp(NamedTuple):
    """A layer's MLP as ops.moe_block takes it: a dense Qwen3NextMLP (gate_up, down) or the
    sparse MoE block (its shared expert, shared_gate, router, top_k, renormalize, experts)."""
    gate_up: PackedLinear                # [2 inter, hidden]: gate rows, then up rows
    down: PackedLinear                   # [hidden, inter]
    shared_gate: Optional[PackedLinear] = None   # [1, hidden]
    router: Optional[PackedLinear] = None        # [num_experts, hidden]
    top_k: int = 0
    renormalize: bool = True
    experts: Optional[PackedExperts] = None


class Qwen3NextDeltaNetLayer(NamedTuple):
    """A linear-attention layer (ops.fused_hybrid's gated delta-net block, the layer's dtype)."""
    in_norm_weight: torch.Tensor         # [hidden] (the (1 + w) norms)
    post_norm_weight: torch.Tensor       # [hidden]
    norm_eps: tuple                      # (in-norm, post-norm, gated-norm) eps
    qkvz_proj: PackedLinear              # [num_k_heads (2 k_dim + 2 ratio v_dim), hidden]
    ba_proj: PackedLinear                # [num_k_heads 2 ratio, hidden]
    out_proj: PackedLinear               # [hidden, num_v_heads v_dim]
    conv_weight: torch.Tensor            # [conv_dim, width]
    conv_bias: Optional[torch.Tensor]    # [conv_dim] or None
    conv_state: torch.Tensor             # [num_slots, conv_dim, >= width - 1]
    state: torch.Tensor                  # float32 [num_slots, num_v_heads, k_dim, v_dim]
    dt_bias: torch.Tensor                # [num_v_heads]
    neg_a: torch.Tensor                  # float32 [num_v_heads]: -exp(A_log)
    gate_norm_weight: torch.Tensor       # [v_dim]
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    scale: float                         # q's scale (k_dim ** -0.5)
    mlp: Qwen3NextMlp


class Qwen3NextAttentionLayer(NamedTuple):
    """A full-attention layer (ops.gated_attention_block's arguments that do not change)."""
    in_norm_weight: torch.Tensor         # [hidden]
    post_norm_weight: torch.Tensor       # [hidden]
    q_norm_weight: torch.Tensor          # [head_dim]
    k_norm_weight: torch.Tensor          # [head_dim]
    norm_eps: tuple                      # (in-norm, post-norm, q-norm, k-norm) eps
    qkv_proj: PackedLinear               # [(2 num_heads + 2 num_kv_heads) head_dim, hidden]
    o_proj: PackedLinear                 # [hidden, num_heads head_dim]
    k_cache: torch.Tensor                # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    num_heads: int
    scale: float                         # the softmax scale
    mlp: Qwen3NextMlp


def _lin(lin: Optional[PackedLinear]) -> tuple:
    return (0, 0) if lin is None else (lin.packed.data_ptr(), _ptr(lin.bias))


def _mlp_args(m: Qwen3NextMlp, hidden: int) -> tuple:
    """(ptrs, sizes, renormalize) as _C.moe_block takes them, x / y / num_tokens left 0."""
    e = m.experts
    ptrs = (0, 0, *_lin(m.gate_up), *_lin(m.down), *_lin(m.shared_gate), *_lin(m.router),
            _ptr(e and e.gate_up), _ptr(e and e.down))
    sizes = (0, hidden, 0, 0, m.down.k, e.num_experts if e else 0, m.top_k if m.router else 0,
             e.gate_up_stride if e else 0, e.down_stride if e else 0, e.inter if e else 0)
    return ptrs, sizes, bool(m.renormalize)


def _checked(i: int, check) -> None:
    """check(), its error naming the layer."""
    try:
        check()
    except (TypeError, ValueError) as e:
        raise type(e)(f"layers[{i}]: {e}") from None


def _check_mlp(m, hidden: int, dtype) -> None:
    if not isinstance(m, Qwen3NextMlp):
        raise TypeError(f"mlp must be a Qwen3NextMlp, got {type(m).__name__}")
    # ops.moe_block's own checks, on no rows
    moe_block(torch.empty(0, hidden, dtype=dtype), m.gate_up, m.down, shared_gate=m.shared_gate,
              router=m.router, top_k=m.top_k if m.router is not None else None,
              renormalize=m.renormalize, experts=m.experts)


def _check_delta_net(l: Qwen3NextDeltaNetLayer, hidden: int, dtype) -> None:
    nk, nv, kd, vd = l.num_k_heads, l.num_v_heads, l.k_dim, l.v_dim
    if not all(isinstance(v, int) and v > 0 for v in (nk, nv, kd, vd)) or nv % nk:
        raise ValueError(f"num_v_heads ({nv}) must be a multiple of num_k_heads ({nk}), k_dim "
                         f"({kd}) and v_dim ({vd}) positive")
    r = nv // nk
    for name in ("in_norm_weight", "post_norm_weight"):
        check_tensor(getattr(l, name), name, ndim=1, dtype=dtype, contiguous=True)
        if getattr(l, name).shape[0] != hidden:
            raise ValueError(f"{name} must be [{hidden}], got {tuple(getattr(l, name).shape)}")
    for name, lin, shape in (("qkvz_proj", l.qkvz_proj, (nk * (2 * kd + 2 * r * vd), hidden)),
                             ("ba_proj", l.ba_proj, (nk * 2 * r, hidden)),
                             ("out_proj", l.out_proj, (hidden, nv * vd))):
        if not isinstance(lin, PackedLinear) or lin.dtype != dtype or (lin.n, lin.k) != shape:
            raise ValueError(f"{name} must be a {dtype} PackedLinear of [n, k] = {list(shape)}")
    if len(l.norm_eps) != 3:
        raise ValueError(f"norm_eps must be (in-norm, post-norm, gated-norm), got {l.norm_eps}")
    # the mixer's tensors: ops.gated_delta_net's own checks, on no rows
    no_rows = (torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
               torch.empty(0, dtype=torch.bool))
    gated_delta_net(torch.empty(0, l.qkvz_proj.n, dtype=dtype),
                    torch.empty(0, l.ba_proj.n, dtype=dtype), l.conv_weight, l.conv_bias,
                    l.conv_state, l.state, l.dt_bias, l.neg_a, l.gate_norm_weight, *no_rows,
                    num_k_heads=nk, num_v_heads=nv, k_dim=kd, v_dim=vd, scale=l.scale,
                    norm_eps=l.norm_eps[2])


def _check_attention(l: Qwen3NextAttentionLayer, hidden: int, dtype, rotary_dim: int) -> None:
    if dtype != torch.bfloat16:
        raise ValueError("an attention layer needs bfloat16 (float32's gate runs torch's "
                         "sigmoid between two calls: ops.gated_attention_block)")
    if len(l.norm_eps) != 4:
        raise ValueError(f"norm_eps must be (in, post, q, k norm) eps, got {l.norm_eps}")
    for name, lin in (("qkv_proj", l.qkv_proj), ("o_proj", l.o_proj)):
        if not isinstance(lin, PackedLinear):
            raise TypeError(f"{name} must be an ops.PackedLinear, got {type(lin).__name__}")
    cos = torch.empty(0, rotary_dim, dtype=dtype)
    index = torch.empty(0, dtype=torch.int64)
    check_attention(torch.empty(0, hidden, dtype=dtype), None, l.in_norm_weight,
                    l.post_norm_weight, l.q_norm_weight, l.k_norm_weight, l.qkv_proj.packed,
                    l.qkv_proj.bias, l.o_proj.packed, l.o_proj.bias, cos, cos, l.k_cache,
                    l.v_cache, index, torch.empty(0, 1, dtype=torch.int32), index.int(),
                    torch.zeros(1, dtype=torch.int32), l.num_heads)


class Qwen3NextStack:
    """Every decoder layer of a Qwen3-Next model and its final norm, one call a step.

    Parameters
    ----------
    embed : ``[vocab, hidden]`` bfloat16 (or float32 without attention layers) CPU,
        contiguous: the input embedding; its dtype is the layers'.
    layers : list of `Qwen3NextDeltaNetLayer` / `Qwen3NextAttentionLayer`; the delta-net layers
        share one num_slots, the attention layers one cache shape.
    final_norm_weight : ``[hidden]``; final_norm_eps : the final norm's epsilon.
    rotary_dim : the width of the step's cos / sin (even, at most head_dim).

    The stack holds the tensors and reads them at every call, where they are then: build a new
    one after replacing any of them (a new PackedLinear included). Its workspace is the calling
    thread's (ops/workspace.py).
    """

    def __init__(self, embed: torch.Tensor, layers: list, final_norm_weight: torch.Tensor,
                 final_norm_eps: float, *, rotary_dim: int):
        check_embed_and_layers(embed, layers, "Qwen3NextDeltaNetLayer / Qwen3NextAttentionLayer")
        self.dtype = dt = embed.dtype
        self.vocab, self.hidden = embed.shape
        self.rotary_dim = rotary_dim
        self.layers = list(layers)
        self.delta_nets = [l for l in layers if isinstance(l, Qwen3NextDeltaNetLayer)]
        self.attentions = [l for l in layers if isinstance(l, Qwen3NextAttentionLayer)]
        for i, l in enumerate(layers):
            if isinstance(l, Qwen3NextDeltaNetLayer):
                _checked(i, lambda: _check_delta_net(l, self.hidden, dt))
            elif isinstance(l, Qwen3NextAttentionLayer):
                _checked(i, lambda: _check_attention(l, self.hidden, dt, rotary_dim))
            else:
                raise TypeError(f"layers[{i}] must be a Qwen3NextDeltaNetLayer or "
                                f"Qwen3NextAttentionLayer, got {type(l).__name__}")
            _checked(i, lambda: _check_mlp(l.mlp, self.hidden, dt))
        if len({l.state.shape[0] for l in self.delta_nets}) > 1:
            raise ValueError("the delta-net layers' state pools must have one num_slots")
        if len({tuple(l.k_cache.shape) for l in self.attentions}) > 1:
            raise ValueError("the attention layers' caches must have one shape")
        check_tensor(final_norm_weight, "final_norm_weight", ndim=1, dtype=dt, contiguous=True)
        if final_norm_weight.shape[0] != self.hidden:
            raise ValueError(f"final_norm_weight must be [{self.hidden}], got "
                             f"{tuple(final_norm_weight.shape)}")
        self.embed, self.final_norm_weight = embed, final_norm_weight
        self.num_slots = self.delta_nets[0].state.shape[0] if self.delta_nets else 0
        self._c = _C.Qwen3NextStack(embed.data_ptr(), self.vocab, self.hidden,
                                    final_norm_weight.data_ptr(), float(final_norm_eps),
                                    DTYPE_CODES[dt])
        for l in self.layers:
            self._add(l)

    def _add(self, l) -> None:
        mlp = _mlp_args(l.mlp, self.hidden)
        if isinstance(l, Qwen3NextDeltaNetLayer):
            self._c.add_delta_net(
                (0, 0, l.in_norm_weight.data_ptr(), l.post_norm_weight.data_ptr(),
                 *_lin(l.qkvz_proj), *_lin(l.ba_proj), *_lin(l.out_proj), 0),
                (0, 0, l.conv_weight.data_ptr(), _ptr(l.conv_bias), l.conv_state.data_ptr(),
                 l.state.data_ptr(), l.dt_bias.data_ptr(), l.neg_a.data_ptr(),
                 l.gate_norm_weight.data_ptr(), 0, 0),
                (l.num_k_heads, l.num_v_heads, l.k_dim, l.v_dim, l.conv_weight.shape[1],
                 l.conv_state.shape[2], 0, 0),
                (float(l.norm_eps[0]), float(l.norm_eps[1]), float(l.scale),
                 float(l.norm_eps[2])), l.state.shape[0], *mlp)
            return
        nb, bs, kv_heads, hd = l.k_cache.shape
        self._c.add_attention(
            (0, 0, l.in_norm_weight.data_ptr(), l.post_norm_weight.data_ptr(),
             l.q_norm_weight.data_ptr(), l.k_norm_weight.data_ptr(), *_lin(l.qkv_proj),
             *_lin(l.o_proj), 0, 0, 0, sigmoid_table().data_ptr(), 0, 0, l.k_cache.data_ptr(),
             l.v_cache.data_ptr(), 0, 0, 0, 0),
            (0, self.hidden, l.num_heads, kv_heads, hd, self.rotary_dim, 0, 0, 0, nb, bs,
             *l.k_cache.stride()[:3], *l.v_cache.stride()[:3]),
            (*map(float, l.norm_eps), float(l.scale)), *mlp)

    def workspace_bytes(self, num_tokens: int, num_sampled: int, num_seqs: int) -> int:
        """Scratch bytes of a call over num_tokens rows (num_sampled of them sampled) of
        num_seqs attention sequences."""
        return self._c.workspace_bytes(num_tokens, num_sampled, num_seqs)

    def __call__(self, input_ids: torch.Tensor, logits_indices: torch.Tensor, slots, cu_seqlens,
                 has_state, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 *, isa: str = "auto") -> torch.Tensor:
        """input_ids: int64 ``[num_tokens]`` in ``[0, vocab)``, the step's packed row;
        logits_indices: int64 ``[num_sampled]`` in ``[0, num_tokens)``; slots int64
        ``[num_seqs]``, cu_seqlens int32 ``[num_seqs + 1]``, has_state bool ``[num_seqs]``: the
        rows (ops.gated_delta_net's); cos, sin: ``[num_tokens, rotary_dim]`` of the dtype;
        slot_mapping, block_tables, seq_lens, cu_seqlens_q: the attention metadata
        (ops.gated_attention_block's); isa caps the kernels' bodies (tests). Returns the final
        norm's ``[num_sampled, hidden]`` in the layers' dtype."""
        n = check_ids(input_ids, logits_indices, self.vocab)
        check_varlen(slots, cu_seqlens, has_state)
        if self.delta_nets:
            check_row_values(self.delta_nets[0].state, slots, cu_seqlens, n)
        if self.attentions:
            l = self.attentions[0]
            for name, t in (("cos", cos), ("sin", sin)):
                check_tensor(t, name, ndim=2, dtype=self.dtype, contiguous=True)
                if t.shape != (n, self.rotary_dim):
                    raise ValueError(f"{name} must be [num_tokens={n}, rotary_dim="
                                     f"{self.rotary_dim}], got {tuple(t.shape)}")
            # ops.gated_attention_block's checks of the metadata, on the first layer's tensors
            check_attention(torch.empty(n, self.hidden, dtype=self.dtype), None,
                            l.in_norm_weight, l.post_norm_weight, l.q_norm_weight,
                            l.k_norm_weight, l.qkv_proj.packed, l.qkv_proj.bias,
                            l.o_proj.packed, l.o_proj.bias, cos, sin, l.k_cache, l.v_cache,
                            slot_mapping, block_tables, seq_lens, cu_seqlens_q, l.num_heads)
        return self.run_unchecked(input_ids, logits_indices, slots, cu_seqlens, has_state, cos,
                                  sin, slot_mapping, block_tables, seq_lens, cu_seqlens_q, isa)

    def run_unchecked(self, input_ids, logits_indices, slots, cu_seqlens, has_state, cos, sin,
                      slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                      isa: str = "auto") -> torch.Tensor:
        """The engine's hot path (runner/hybrid_stack.py): __call__ without the checks (the
        C++ still refuses ids, sampled rows and attention indices out of range)."""
        rows = rows_arg(slots, cu_seqlens, has_state, self.num_slots)
        n, s = input_ids.shape[0], logits_indices.shape[0]
        num_seqs = block_tables.shape[0]
        out = torch.empty((s, self.hidden), dtype=self.dtype)
        ws = workspace.scratch(self._c.workspace_bytes(n, s, num_seqs))
        sync_threads()
        self._c(input_ids.data_ptr(), logits_indices.data_ptr(), s, out.data_ptr(),
                ws.data_ptr(), rows,
                (cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(),
                 block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr()),
                (num_seqs, block_tables.shape[1], block_tables.stride(0)), isa)
        return out

