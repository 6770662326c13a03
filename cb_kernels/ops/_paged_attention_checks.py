"""Argument checks of `paged_attention`: every wrong input raises ValueError/TypeError naming it.

Shape, dtype, device and stride checks are free (tensor metadata). Value checks (cu_seqlens_q
monotone, q_len <= seq_len, block ids inside the pool, seq_len covered by the block table) need
the index tensors' contents: they run for CPU tensors only, through numpy views (~20 us for 64
sequences; torch ops on such tiny tensors cost ~5 us each, numpy ~1 us). On CUDA they are skipped:
reading device values would sync the host with the stream on every call and break CUDA graphs.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

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


def check_values(num_tokens: int, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """Index checks on CPU tensors (see the module docstring for why CUDA skips them)."""
    if block_tables.device.type != "cpu":
        return
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    cu = cu_seqlens_q.numpy().astype(np.int64)
    lens = seq_lens.numpy().astype(np.int64)
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at num_tokens={num_tokens}, got "
                         f"{cu[0]} .. {cu[-1]}")
    if (lens < 0).any():
        i = int(np.argmax(lens < 0))
        raise ValueError(f"seq_lens[{i}]={lens[i]} is negative")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        i = int(np.argmax(q_lens < 0))
        raise ValueError(f"cu_seqlens_q must be non-decreasing: cu_seqlens_q[{i}]={cu[i]} > "
                         f"cu_seqlens_q[{i + 1}]={cu[i + 1]}")
    if (q_lens > lens).any():
        i = int(np.argmax(q_lens > lens))
        raise ValueError(f"sequence {i} has {q_lens[i]} q tokens (cu_seqlens_q) but seq_lens[{i}]="
                         f"{lens[i]}: q tokens must be the last positions of the sequence")
    if lens.size and lens.max() > 2**31 - 1 - block_size:
        raise ValueError(f"seq_lens must stay below 2**31 - block_size, got {lens.max()}")
    needed = (lens + block_size - 1) // block_size
    max_blocks = block_tables.shape[1]
    if (needed > max_blocks).any():
        i = int(np.argmax(needed > max_blocks))
        raise ValueError(f"seq_lens[{i}]={lens[i]} needs {needed[i]} blocks of {block_size} but "
                         f"block_tables has only {max_blocks} columns")
    if needed.size == 0 or needed.max() == 0:
        return
    table = block_tables.numpy()[:, :needed.max()]
    used = np.arange(table.shape[1])[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{i}, {j}]={table[i, j]} is outside the pool of "
                         f"{num_blocks} blocks (k_cache.shape[0])")
