"""Argument checks of `paged_attention`: every wrong input raises ValueError/TypeError naming it.

Shape, dtype, device and stride checks are free (tensor metadata). Value checks (cu_seqlens_q
monotone, q_len <= seq_len, block ids inside the pool, seq_len covered by the block table) need
the index tensors' contents: they run for CPU tensors only, in C++ (~1 us for 64 sequences; the
same checks as numpy calls took ~60 us a call). On CUDA they are skipped: reading device values
would sync the host with the stream on every call and break CUDA graphs.
"""
from __future__ import annotations

import math
import numbers

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import check_tensor, dtype_code, same_device


def check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, sliding_window,
               softcap, out) -> tuple[float, int, float]:
    """Check everything but index values; return (scale, window, softcap) with 0 meaning "off"."""
    check_tensor(q, "q", ndim=3)
    dtype_code(q, "q")
    check_tensor(k_cache, "k_cache", ndim=4, dtype=q.dtype)
    check_tensor(v_cache, "v_cache", ndim=4, dtype=q.dtype)
    check_tensor(block_tables, "block_tables", ndim=2, dtype=torch.int32)
    check_tensor(seq_lens, "seq_lens", ndim=1, dtype=torch.int32)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1, dtype=torch.int32)
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
             ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)]
    if out is not None:
        check_tensor(out, "out", ndim=3, dtype=q.dtype)
        named.append(("out", out))
    same_device(named)

    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if kv_dim != head_dim:
        raise ValueError(f"k_cache head_dim {kv_dim} differs from q head_dim {head_dim}")
    if head_dim == 0 or num_heads == 0 or block_size == 0 or num_kv_heads == 0:
        raise ValueError(f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} must have "
                         "non-zero num_heads, head_dim, block_size and num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"q num_heads {num_heads} must be a multiple of k_cache num_kv_heads "
                         f"{num_kv_heads} (grouped-query attention)")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has "
                         f"{num_seqs} rows (one per sequence)")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got "
                         f"{cu_seqlens_q.shape[0]}")
    if out is not None and tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}")
    # Kernels take element strides but need unit stride on the innermost axis to vectorise.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                    ("block_tables", block_tables)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                             f"{t.stride()}")
    for name, t in (("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        check_tensor(t, name, contiguous=True)

    if scale is None:
        scale = head_dim ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number or None, got {scale!r}")
    if sliding_window is None:
        window = 0
    elif isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    elif sliding_window < 1 or sliding_window > 2**31 - 1:
        raise ValueError(f"sliding_window must be in [1, 2**31 - 1], got {sliding_window}")
    else:
        window = int(sliding_window)
    if softcap is None:
        cap = 0.0
    elif isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
    elif not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number, got {softcap}")
    else:
        cap = float(softcap)
    return float(scale), window, cap


def check_sinks(sinks, q: torch.Tensor) -> None:
    """sinks: None or fp32 [num_heads] on q's device, contiguous."""
    if sinks is None:
        return
    check_tensor(sinks, "sinks", ndim=1, dtype=torch.float32, contiguous=True)
    same_device([("q", q), ("sinks", sinks)])
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must have one logit per q head ({q.shape[1]}), got "
                         f"{sinks.shape[0]}")


def check_values(num_tokens: int, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """Index checks on CPU tensors (see the module docstring for why CUDA skips them)."""
    if block_tables.device.type != "cpu":
        return
    err = _C.paged_attention_index_error(
        block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
        block_tables.shape[0], block_tables.shape[1], block_tables.stride(0), num_tokens,
        k_cache.shape[0], k_cache.shape[1])
    if err:
        raise ValueError(err)
