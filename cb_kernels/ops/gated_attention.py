"""`gated_attention_block`: Qwen3-Next's full-attention layer up to its MLP in one call
(csrc/cpu/fused_gated_attention.cpp says why; cb_kernels/fused_gated_attention.h what it
computes): the input norm with the pending residual, the packed q(+gate)/k/v GEMM, q_norm and
k_norm per head, partial rotary, the KV write, paged attention, the sigmoid output gate,
o_proj and the post norm with its residual; x is updated in place, the post norm's output
returned for the MLP.

The kernels inside are the separate ops' own (offset_rms_norm, PackedLinear, rope_, write_kv,
paged_attention, "cpu"), so the result is the bits of those calls made one by one as
runner/hybrid_layers.py made them, the gate's sigmoid included: that is torch's (transformers'
formula), whose fp32 result C++ cannot repeat bit for bit. bf16 reads it from a table of
torch.sigmoid over every bf16 value (one call); fp32 runs two C++ calls with torch.sigmoid of
the gate between them. ``ref_gated_attention_block`` composes ops/reference.py's references.
CPU, float32 or bfloat16; causal attention with no window, softcap or sinks.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, check_tensor, sync_threads
from cb_kernels.ops._cache_checks import check_slot_values
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.paged_attention import check_values
from cb_kernels.ops.reference import (ref_offset_rms_norm, ref_paged_attention, ref_rope_,
                                      ref_write_kv)
from cb_kernels.ops import workspace


@functools.lru_cache(maxsize=1)
def sigmoid_table() -> torch.Tensor:
    """int16 [65536]: entry b holds the bits of torch.sigmoid of the bf16 value with bits b.
    torch's bf16 sigmoid depends on the value alone (its vector and scalar loops agree on every
    input: tests/ops/test_gated_attention.py), so a lookup is its result."""
    bits = torch.cat([torch.arange(0, 32768), torch.arange(-32768, 0)]).to(torch.int16)
    return torch.sigmoid(bits.view(torch.bfloat16)).view(torch.int16).contiguous()


def gated_attention_block(x: torch.Tensor, pending: Optional[torch.Tensor],
                          in_norm_weight: torch.Tensor, post_norm_weight: torch.Tensor,
                          qkv_proj: PackedLinear, o_proj: PackedLinear,
                          q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, *, norm_eps: float,
                          scale: Optional[float] = None, isa: str = "auto") -> torch.Tensor:
    """Qwen3-Next's attention layer up to its MLP; x, k_cache and v_cache updated in place.

    Parameters
    ----------
    x : contiguous float32 or bfloat16 CPU ``[num_tokens, hidden]``, the residual stream:
        ``x += pending``, then ``x += o_proj(attention)``.
    pending : ``[num_tokens, hidden]`` like x (the previous MLP's output) or None.
    in_norm_weight, post_norm_weight : ``[hidden]``; q_norm_weight, k_norm_weight :
        ``[head_dim]``: the Qwen3NextRMSNorm weights (the norms scale by ``1 + weight``).
    qkv_proj : PackedLinear of x's dtype, ``[(2 num_heads + 2 num_kv_heads) head_dim, hidden]``:
        per q head its q then its gate (head_dim each), then k, then v.
    o_proj : PackedLinear ``[hidden, num_heads head_dim]``.
    cos, sin : contiguous ``[num_tokens, rotary_dim]`` of x's dtype (rotary_dim even, at most
        head_dim): the rotary of the first rotary_dim dims of each q and k head.
    k_cache, v_cache : ``[num_blocks, block_size, num_kv_heads, head_dim]`` of x's dtype.
    slot_mapping : int64 ``[num_tokens]`` (-1 skips a token); block_tables, seq_lens,
        cu_seqlens_q : as ops.paged_attention's.
    norm_eps : the four norms' eps; scale : the softmax scale (default head_dim ** -0.5).
    isa : caps the body of every kernel inside ("auto" or one of ``_C.cpu_isas()``; tests).

    Returns the post norm's output, a new ``[num_tokens, hidden]``.
    """
    for name, lin in (("qkv_proj", qkv_proj), ("o_proj", o_proj)):
        if not isinstance(lin, PackedLinear):
            raise TypeError(f"{name} must be an ops.PackedLinear, got {type(lin).__name__}")
    check_tensor(x, "x", ndim=2, contiguous=True)
    check_tensor(k_cache, "k_cache", ndim=4)
    kv_heads, hd = k_cache.shape[2], k_cache.shape[3]
    rows = qkv_proj.n - 2 * kv_heads * hd
    num_heads = rows // (2 * hd) if hd else 0
    if hd == 0 or rows <= 0 or rows % (2 * hd):
        raise ValueError(f"qkv_proj must have (2 num_heads + 2 num_kv_heads) head_dim rows "
                         f"(num_kv_heads={kv_heads}, head_dim={hd}: k_cache's), got {qkv_proj.n}")
    for name, lin, n, k in (("qkv_proj", qkv_proj, qkv_proj.n, x.shape[-1]),
                            ("o_proj", o_proj, x.shape[-1], num_heads * hd)):
        if (lin.n, lin.k) != (n, k):
            raise ValueError(f"{name} must be [{n}, {k}] (out, in), got [{lin.n}, {lin.k}]")
    _check(x, pending, in_norm_weight, post_norm_weight, q_norm_weight, k_norm_weight,
           qkv_proj.packed, qkv_proj.bias, o_proj.packed, o_proj.bias, cos, sin, k_cache,
           v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_heads)
    if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or norm_eps < 0:
        raise ValueError(f"norm_eps must be a non-negative number, got {norm_eps!r}")
    if scale is None:
        scale = hd ** -0.5
    eps = (float(norm_eps),) * 4
    return gated_attention_block_unchecked(
        x, pending, in_norm_weight, post_norm_weight, qkv_proj.packed, qkv_proj.bias,
        o_proj.packed, o_proj.bias, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache,
        slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_heads, eps, float(scale), isa)


def _check(x, pending, in_w, post_w, q_w, k_w, qkv_packed, qkv_bias, o_packed, o_bias, cos, sin,
           k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
           num_heads: int) -> None:
    """Every check of `gated_attention_block`'s arguments on the PackedLinears' tensors."""
    check_tensor(x, "x", ndim=2, contiguous=True)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise TypeError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on {x.device}")
    n, hidden = x.shape
    dt = x.dtype
    if pending is not None:
        check_tensor(pending, "pending", ndim=2, dtype=dt, contiguous=True)
        if pending.shape != x.shape:
            raise ValueError(f"pending must be x's shape {tuple(x.shape)}, got "
                             f"{tuple(pending.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(t, name, ndim=4, dtype=dt)
        if t.device.type != "cpu" or t.stride(3) != 1:
            raise ValueError(f"{name} must be a CPU tensor with head_dim packed, got strides "
                             f"{t.stride()} on {t.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)}")
    num_blocks, block_size, kv_heads, hd = k_cache.shape
    if 0 in (num_blocks, block_size, kv_heads, hd):
        raise ValueError(f"k_cache must have no empty axis, got {tuple(k_cache.shape)}")
    for name, t, size in (("in_norm_weight", in_w, hidden), ("post_norm_weight", post_w, hidden),
                          ("q_norm_weight", q_w, hd), ("k_norm_weight", k_w, hd)):
        check_tensor(t, name, ndim=1, dtype=dt, contiguous=True)
        if t.shape[0] != size:
            raise ValueError(f"{name} must be [{size}], got {tuple(t.shape)}")
    rd = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() == 2 else -1
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, name, ndim=2, dtype=dt, contiguous=True)
        if t.shape != (n, rd) or rd % 2 or rd > hd:
            raise ValueError(f"{name} must be [num_tokens={n}, rotary_dim] with rotary_dim even "
                             f"and at most head_dim={hd} (cos's), got {tuple(t.shape)}")
    packed_elems = _C.linear_bf16_packed_elems if dt == torch.bfloat16 else \
        _C.linear_packed_floats
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 or \
            num_heads % kv_heads:
        raise ValueError(f"num_heads must be a positive multiple of num_kv_heads={kv_heads}, "
                         f"got {num_heads!r}")
    for name, t, rows, cols in (("qkv", qkv_packed, (2 * num_heads + 2 * kv_heads) * hd, hidden),
                                ("o", o_packed, hidden, num_heads * hd)):
        check_tensor(t, f"{name}_packed", ndim=1, dtype=dt, contiguous=True)
        if t.numel() != packed_elems(rows, cols):
            raise ValueError(f"{name}_packed must be a PackedLinear's packed [{rows}, {cols}] "
                             f"weight (qkv: (2 num_heads + 2 num_kv_heads) head_dim rows, "
                             f"num_kv_heads={kv_heads}, head_dim={hd})")
    for name, t, size in (("qkv_bias", qkv_bias, (2 * num_heads + 2 * kv_heads) * hd),
                          ("o_bias", o_bias, hidden)):
        if t is not None:
            check_tensor(t, name, ndim=1, dtype=torch.float32, contiguous=True)
            if t.shape[0] != size:
                raise ValueError(f"{name} must be [{size}], got {tuple(t.shape)}")
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtype=torch.int64, contiguous=True)
    if slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping must have num_tokens={n} entries, got "
                         f"{slot_mapping.shape[0]}")
    check_tensor(block_tables, "block_tables", ndim=2, dtype=torch.int32)
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"block_tables must have unit stride in its last dimension, got "
                         f"strides {block_tables.stride()}")
    check_tensor(seq_lens, "seq_lens", ndim=1, dtype=torch.int32, contiguous=True)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1, dtype=torch.int32, contiguous=True)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"seq_lens must have num_seqs={num_seqs} entries (block_tables' rows) "
                         f"and cu_seqlens_q num_seqs + 1, got {seq_lens.shape[0]} and "
                         f"{cu_seqlens_q.shape[0]}")
    for name, t in (("slot_mapping", slot_mapping), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got {t.device}")
    if n and num_seqs == 0:
        raise ValueError(f"{n} tokens but no sequence (block_tables has no rows)")
    check_values(n, k_cache, block_tables, seq_lens, cu_seqlens_q)
    check_slot_values(slot_mapping, num_blocks * block_size)


def gated_attention_block_workspace_bytes(num_tokens: int, num_seqs: int, hidden: int,
                                          num_heads: int, num_kv_heads: int, head_dim: int,
                                          dtype: torch.dtype) -> int:
    """Scratch bytes of a `gated_attention_block_unchecked` call of num_tokens rows over
    num_seqs sequences, for sizing ops/workspace.py's buffer before the first step (the cache's
    fields do not change it)."""
    size = (num_tokens, hidden, num_heads, num_kv_heads, head_dim, head_dim, num_seqs) + (0,) * 10
    return _C.gated_attention_workspace_bytes(size, DTYPE_CODES[dtype])


def gated_attention_block_unchecked(x, pending, in_norm_weight, post_norm_weight, qkv_packed,
                                    qkv_bias, o_packed, o_bias, q_norm_weight, k_norm_weight,
                                    cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                    seq_lens, cu_seqlens_q, num_heads: int, eps: tuple,
                                    scale: float, isa: str = "auto") -> torch.Tensor:
    """The engine's hot path (runner/hybrid_layers.py): `gated_attention_block` without the
    Python checks (the C++ still refuses bad attention indices), on the PackedLinears' tensors;
    eps: (in-norm, post-norm, q-norm, k-norm)."""
    n, hidden = x.shape
    num_blocks, block_size, kv_heads, hd = k_cache.shape
    h_out = torch.empty((n, hidden), dtype=x.dtype)
    if n == 0:
        return h_out
    size = (n, hidden, num_heads, kv_heads, hd, cos.shape[1], block_tables.shape[0],
            block_tables.shape[1], block_tables.stride(0), num_blocks, block_size,
            *k_cache.stride()[:3], *v_cache.stride()[:3])
    code = DTYPE_CODES[x.dtype]
    ws = workspace.scratch(_C.gated_attention_workspace_bytes(size, code))
    bf16 = x.dtype == torch.bfloat16
    ptr = [x.data_ptr(), _ptr(pending), in_norm_weight.data_ptr(), post_norm_weight.data_ptr(),
           q_norm_weight.data_ptr(), k_norm_weight.data_ptr(), qkv_packed.data_ptr(),
           _ptr(qkv_bias), o_packed.data_ptr(), _ptr(o_bias), cos.data_ptr(), sin.data_ptr(), 0,
           sigmoid_table().data_ptr() if bf16 else 0, h_out.data_ptr(), ws.data_ptr(),
           k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
           block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr()]
    f = (*eps, scale)
    sync_threads()
    if bf16:
        _C.gated_attention_block(ptr, size, f, isa, code)
        return h_out
    # fp32: torch's sigmoid of the gate between the halves, as the separate calls take it
    _C.gated_attention_qkv(ptr, size, f, isa, code)
    q = num_heads * hd
    qkv = ws[:n * (2 * q + 2 * kv_heads * hd) * 4].view(x.dtype).view(n, -1)
    gate = qkv[:, :2 * q].view(n, num_heads, 2 * hd)[..., hd:].reshape(n, -1).sigmoid()
    ptr[12] = gate.data_ptr()
    _C.gated_attention_rest(ptr, size, f, isa, code)
    return h_out


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def ref_gated_attention_block(x, pending, in_norm_weight, post_norm_weight, qkv_weight, qkv_bias,
                              o_weight, o_bias, q_norm_weight, k_norm_weight, cos, sin, k_cache,
                              v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, *,
                              num_heads: int, norm_eps: float, scale: float) -> torch.Tensor:
    """transformers' Qwen3NextDecoderLayer up to its MLP, on the references of each step
    (weights unpacked: qkv_weight ``[(2 num_heads + 2 num_kv_heads) head_dim, hidden]``)."""
    n, hd = x.shape[0], k_cache.shape[3]
    kv = k_cache.shape[2] * hd
    h = ref_offset_rms_norm(x, in_norm_weight, norm_eps, pending)
    qg, k, v = F.linear(h, qkv_weight, qkv_bias).split([2 * num_heads * hd, kv, kv], dim=-1)
    qg = qg.reshape(n, num_heads, 2 * hd)
    q = ref_offset_rms_norm(qg[..., :hd], q_norm_weight, norm_eps)
    k = ref_offset_rms_norm(k.reshape(n, -1, hd), k_norm_weight, norm_eps)
    rd = cos.shape[-1]
    q[..., :rd] = ref_rope_(q[..., :rd].clone(), cos, sin)
    k[..., :rd] = ref_rope_(k[..., :rd].clone(), cos, sin)
    ref_write_kv(k, v.reshape(n, -1, hd), k_cache, v_cache, slot_mapping)
    out = ref_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                              scale=scale)
    out = out.reshape(n, -1) * torch.sigmoid(qg[..., hd:].reshape(n, -1))
    return ref_offset_rms_norm(x, post_norm_weight, norm_eps, F.linear(out, o_weight, o_bias))


# The torch.library op on the PackedLinears' tensors, so torch.compile can trace the call.
@torch.library.custom_op("cb_kernels::gated_attention_block",
                         mutates_args=("x", "k_cache", "v_cache"))
def _gated_attention_block_op(
        x: torch.Tensor, pending: Optional[torch.Tensor], in_norm_weight: torch.Tensor,
        post_norm_weight: torch.Tensor, qkv_packed: torch.Tensor, qkv_bias: Optional[torch.Tensor],
        o_packed: torch.Tensor, o_bias: Optional[torch.Tensor], q_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_heads: int, norm_eps: float,
        scale: float) -> torch.Tensor:
    _check(x, pending, in_norm_weight, post_norm_weight, q_norm_weight, k_norm_weight,
           qkv_packed, qkv_bias, o_packed, o_bias, cos, sin, k_cache, v_cache, slot_mapping,
           block_tables, seq_lens, cu_seqlens_q, num_heads)
    return gated_attention_block_unchecked(
        x, pending, in_norm_weight, post_norm_weight, qkv_packed, qkv_bias, o_packed, o_bias,
        q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
        seq_lens, cu_seqlens_q, num_heads, (float(norm_eps),) * 4, float(scale))


@_gated_attention_block_op.register_fake
def _(x, pending, in_norm_weight, post_norm_weight, qkv_packed, qkv_bias, o_packed, o_bias,
      q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
      seq_lens, cu_seqlens_q, num_heads, norm_eps, scale):
    return x.new_empty(x.shape)
