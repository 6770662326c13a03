"""A Mamba2ForCausalLM step's backbone in one C++ call: the embedding, every Mamba-2 block (the
norm, in_proj, conv, scan, gated norm, out_proj, residual add: ``mamba2_block``) and the final
norm of the sampled rows (csrc/cpu/mamba2_stack.cpp says why; cb_kernels/fused_hybrid.h,
``Mamba2StackParams``, what it computes).

``Mamba2Stack(embed, layers, final_norm_weight, final_norm_eps, residual_fp32=...)`` checks and
holds the layers' tensors once; each call passes the step's token ids, sampled rows and varlen
rows and updates every layer's conv and recurrent state slots in place. The bits are those of
the calls apart (``mamba2_block_unchecked`` per layer, ``rms_norm``, the casts and the row
selection: tests/ops/test_fused_hybrid.py). CPU, float32 or bfloat16.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, check_tensor, sync_threads
from cb_kernels.ops._stack import check_embed_and_layers, check_ids
from cb_kernels.ops._varlen import check_values, check_varlen, rows_arg
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops import workspace


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


class Mamba2StackLayer(NamedTuple):
    """One Mamba2Block's tensors (inner = num_heads head_dim, conv_dim = inner + 2 num_groups
    d_state, the layer's dtype unless said)."""
    norm_weight: torch.Tensor        # [hidden]: the block's RMSNorm (Llama's formula)
    norm_eps: float
    in_proj: PackedLinear            # [inner + conv_dim + num_heads, hidden]: gate, xBC, dt
    out_proj: PackedLinear           # [hidden, inner]
    conv_weight: torch.Tensor        # [conv_dim, width <= 16]
    conv_bias: Optional[torch.Tensor]    # [conv_dim] or None
    conv_state: torch.Tensor         # [num_slots, conv_dim, >= width - 1]
    state: torch.Tensor              # float32 [num_slots, num_heads, head_dim, d_state]
    A: torch.Tensor                  # float32 [num_heads]: -exp(A_log)
    D: torch.Tensor                  # float32 [num_heads]
    dt_bias: torch.Tensor            # float32 [num_heads]
    gate_norm_weight: torch.Tensor   # [inner]: the mixer's gated RMSNorm
    gate_norm_eps: float
    num_heads: int
    head_dim: int
    num_groups: int
    d_state: int
    norm_group_size: int             # elements the gated norm normalises together


def _check_vector(t, name: str, n: int, dtype) -> None:
    check_tensor(t, name, ndim=1, dtype=dtype, contiguous=True)
    if t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")


def _check_layer(i: int, layer, hidden: int, dtype, num_slots: int) -> None:
    if not isinstance(layer, Mamba2StackLayer):
        raise TypeError(f"layers[{i}] must be a Mamba2StackLayer, got {type(layer).__name__}")
    at = f"layers[{i}]."
    nh, hd, ng, ds, group = (layer.num_heads, layer.head_dim, layer.num_groups, layer.d_state,
                             layer.norm_group_size)
    if not all(isinstance(v, int) and v > 0 for v in (nh, hd, ng, ds, group)) or nh % ng or \
            (nh * hd) % group:
        raise ValueError(f"{at}num_heads ({nh}) must be a multiple of num_groups ({ng}), "
                         f"head_dim ({hd}), d_state ({ds}) positive, norm_group_size ({group}) "
                         f"dividing num_heads * head_dim")
    inner = nh * hd
    conv_dim = inner + 2 * ng * ds
    _check_vector(layer.norm_weight, at + "norm_weight", hidden, dtype)
    _check_vector(layer.gate_norm_weight, at + "gate_norm_weight", inner, dtype)
    for name, lin, shape in (("in_proj", layer.in_proj, (inner + conv_dim + nh, hidden)),
                             ("out_proj", layer.out_proj, (hidden, inner))):
        if not isinstance(lin, PackedLinear) or lin.dtype != dtype or (lin.n, lin.k) != shape:
            raise ValueError(f"{at}{name} must be a {dtype} PackedLinear of [n, k] = "
                             f"{list(shape)}")
    check_tensor(layer.conv_weight, at + "conv_weight", ndim=2, dtype=dtype, contiguous=True)
    width = layer.conv_weight.shape[1]
    if layer.conv_weight.shape[0] != conv_dim or not 1 <= width <= 16:
        raise ValueError(f"{at}conv_weight must be [conv_dim={conv_dim}, width <= 16], got "
                         f"{tuple(layer.conv_weight.shape)}")
    if layer.conv_bias is not None:
        _check_vector(layer.conv_bias, at + "conv_bias", conv_dim, dtype)
    check_tensor(layer.conv_state, at + "conv_state", ndim=3, dtype=dtype, contiguous=True)
    if tuple(layer.conv_state.shape[:2]) != (num_slots, conv_dim) or \
            layer.conv_state.shape[2] < width - 1:
        raise ValueError(f"{at}conv_state must be [num_slots={num_slots}, {conv_dim}, >= "
                         f"{width - 1}], got {tuple(layer.conv_state.shape)}")
    check_tensor(layer.state, at + "state", ndim=4, dtype=torch.float32, contiguous=True)
    if tuple(layer.state.shape) != (num_slots, nh, hd, ds):
        raise ValueError(f"{at}state must be [{num_slots}, {nh}, {hd}, {ds}], got "
                         f"{tuple(layer.state.shape)}")
    for name in ("A", "D", "dt_bias"):
        _check_vector(getattr(layer, name), at + name, nh, torch.float32)


class Mamba2Stack:
    """Every Mamba-2 block of a model and its final norm, one call a step.

    Parameters
    ----------
    embed : ``[vocab, hidden]`` float32 or bfloat16 CPU, contiguous: the input embedding; its
        dtype is the layers' dtype.
    layers : list of `Mamba2StackLayer`, every one of the same num_slots.
    final_norm_weight : ``[hidden]`` of the residual stream's dtype (float32 with
        ``residual_fp32``, else the layers' dtype).
    final_norm_eps : the final norm's epsilon.
    residual_fp32 : the blocks' residual stream in float32 (Mamba-2's ``residual_in_fp32``).

    The stack holds the tensors and reads them at every call, where they are then: build a new
    one after replacing any of them (a new PackedLinear included). Its workspace is the calling
    thread's (ops/workspace.py).
    """

    def __init__(self, embed: torch.Tensor, layers: list, final_norm_weight: torch.Tensor,
                 final_norm_eps: float, *, residual_fp32: bool):
        check_embed_and_layers(embed, layers, "Mamba2StackLayer")
        self.dtype = embed.dtype
        self.vocab, self.hidden = embed.shape
        self.x_dtype = torch.float32 if residual_fp32 else self.dtype
        num_slots = layers[0].state.shape[0] if isinstance(layers[0], Mamba2StackLayer) else 0
        for i, layer in enumerate(layers):
            _check_layer(i, layer, self.hidden, self.dtype, num_slots)
        _check_vector(final_norm_weight, "final_norm_weight", self.hidden, self.x_dtype)
        self.embed, self.layers, self.final_norm_weight = embed, list(layers), final_norm_weight
        self.num_slots = num_slots
        self._c = _C.Mamba2Stack(
            [((0, l.norm_weight.data_ptr(), l.in_proj.packed.data_ptr(), _ptr(l.in_proj.bias),
               l.out_proj.packed.data_ptr(), _ptr(l.out_proj.bias), 0),
              (0, l.conv_weight.data_ptr(), _ptr(l.conv_bias), l.conv_state.data_ptr(),
               l.state.data_ptr(), l.A.data_ptr(), l.D.data_ptr(), l.dt_bias.data_ptr(),
               l.gate_norm_weight.data_ptr(), 0, 0),
              (l.num_heads, l.head_dim, l.num_groups, l.d_state, l.norm_group_size,
               l.conv_weight.shape[1], l.conv_state.shape[2], 0),
              float(l.norm_eps), float(l.gate_norm_eps)) for l in self.layers],
            embed.data_ptr(), self.vocab, self.hidden, final_norm_weight.data_ptr(),
            float(final_norm_eps), DTYPE_CODES[self.x_dtype], DTYPE_CODES[self.dtype])

    def workspace_bytes(self, num_tokens: int, num_sampled: int) -> int:
        """Scratch bytes of a call over num_tokens rows, num_sampled of them sampled."""
        return self._c.workspace_bytes(num_tokens, num_sampled)

    def __call__(self, input_ids: torch.Tensor, logits_indices: torch.Tensor, slots, cu_seqlens,
                 has_state, *, isa: str = "auto") -> torch.Tensor:
        """input_ids: int64 ``[num_tokens]`` in ``[0, vocab)``, the step's packed row;
        logits_indices: int64 ``[num_sampled]`` in ``[0, num_tokens)``; slots int64
        ``[num_seqs]``, cu_seqlens int32 ``[num_seqs + 1]``, has_state bool ``[num_seqs]``: the
        rows (ops.selective_scan's); isa caps the mixers' kernels (tests). Returns the final
        norm's ``[num_sampled, hidden]`` in the layers' dtype."""
        n = check_ids(input_ids, logits_indices, self.vocab)
        check_varlen(slots, cu_seqlens, has_state)
        check_values(self.layers[0].state, slots, cu_seqlens, n)
        return self.run_unchecked(input_ids, logits_indices, slots, cu_seqlens, has_state, isa)

    def run_unchecked(self, input_ids: torch.Tensor, logits_indices: torch.Tensor, slots,
                      cu_seqlens, has_state, isa: str = "auto") -> torch.Tensor:
        """The engine's hot path (runner/hybrid_stack.py): __call__ without the checks."""
        rows = rows_arg(slots, cu_seqlens, has_state, self.num_slots)
        n, s = input_ids.shape[0], logits_indices.shape[0]
        out = torch.empty((s, self.hidden), dtype=self.dtype)
        ws = workspace.scratch(self._c.workspace_bytes(n, s))
        sync_threads()
        self._c(input_ids.data_ptr(), logits_indices.data_ptr(), s, out.data_ptr(),
                ws.data_ptr(), rows, isa)
        return out
