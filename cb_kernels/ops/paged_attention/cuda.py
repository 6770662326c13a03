"""The "cuda" backend of `paged_attention`: the compiled split-KV decode kernel
(csrc/cuda/paged_attention.cu) for q_len == 1 sequences, the Triton kernel for the rest.

Prefill goes to the Triton kernel rather than a second hand-written CUDA kernel: prefill is
compute-bound and wants tensor cores (mma/wgmma tiles, which tl.dot emits on sm_80/sm_90), while a
decode step is a bandwidth-bound gather through the block table, where the hand-written 16-byte
vector loads and one K/V pass per GQA group pay off. Each sequence always takes the same kernel
(decode: CUDA, q_len > 1: Triton), whatever else is in its batch, so its numerics never depend on
the batch mix. bench/gpu_check.sh times both against the Triton-only backend.
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import dtype_code

HEAD_DIMS = (64, 80, 96, 128, 256)


def check_cuda_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What the CUDA kernel needs beyond the generic checks: a compiled head_dim, a power-of-two
    block_size and 16-byte aligned K/V rows (its vector loads)."""
    head_dim = q.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"backend='cuda' supports head_dim in {HEAD_DIMS}, got q head_dim "
                         f"{head_dim} (use backend='triton')")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"backend='cuda' needs a power-of-two block_size, got k_cache block_size "
                         f"{block_size}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        size = t.element_size()
        if t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:3]):
            raise ValueError(f"backend='cuda' needs 16-byte aligned rows in {name} (data_ptr "
                             f"{t.data_ptr():#x}, strides {t.stride()} of {size}-byte values)")


def paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                         sliding_window, softcap, sinks=None) -> None:
    """Write attention into out. Arguments were checked by cb_kernels.ops.paged_attention;
    shapes: q/out [num_tokens, num_heads, head_dim], k_cache/v_cache [num_blocks, block_size,
    num_kv_heads, head_dim], block_tables int32 [num_seqs, max_blocks_per_seq], seq_lens int32
    [num_seqs], cu_seqlens_q int32 [num_seqs + 1]; sinks None or fp32 [num_heads]. Never
    reads device values on the host, so a CUDA graph can capture it (the grid comes from shapes
    only)."""
    check_cuda_args(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_seqs == 0 or num_tokens == 0:
        return
    if num_tokens > num_seqs:
        try:
            from cb_kernels.triton.paged_attention import paged_attention_prefill_triton
        except ImportError as e:
            raise RuntimeError("backend='cuda' runs q_len > 1 sequences with the Triton kernel, "
                               f"which cannot be imported here: {e}") from e
        paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                       out, scale, sliding_window, softcap, sinks)
    span = max_blocks * block_size
    if sliding_window is not None:
        span = min(span, sliding_window)
    max_splits = _C.paged_attention_cuda_max_splits(span)
    if max_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, max_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, max_splits, 2), dtype=torch.float32,
                              device=q.device)
        part_ptrs = (part_out.data_ptr(), part_ml.data_ptr())
    else:
        part_ptrs = (0, 0)
    _C.paged_attention_cuda(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), *part_ptrs,
        num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), max_splits,
        dtype_code(q, "q"), float(scale), sliding_window or 0,
        float(softcap) if softcap is not None else 0.0, num_tokens <= num_seqs,
        torch.cuda.current_stream(q.device).cuda_stream,
        sinks.data_ptr() if sinks is not None else 0)
