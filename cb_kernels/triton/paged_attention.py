"""Triton paged attention: one kernel for prefill, chunked prefill and decode, plus a split reduce.

Layouts: q/out [num_tokens, num_heads, head_dim]; k_cache/v_cache [num_blocks, block_size,
num_kv_heads, head_dim] (any strides); block_tables int32 [num_seqs, max_blocks_per_seq];
seq_lens int32 [num_seqs]; cu_seqlens_q int32 [num_seqs + 1].

`_paged_attention_kernel` has two specialisations of one body:
- IS_DECODE=False (grid: q-blocks x kv heads). A tile holds BLOCK_Q query tokens x the GROUP
  query heads of one kv head, so every K/V tile it loads serves all heads of the group. The q-block
  count is the bound num_tokens // BLOCK_Q + num_seqs, known on the host from shapes alone;
  programs past their sequence's end return at once. Sequences with q_len == 1 are skipped.
- IS_DECODE=True (grid: seqs x kv heads x splits). Only sequences with q_len == 1; the keys are
  cut into splits whose count depends on that sequence's attended length alone (never on the
  batch), so a sequence's reduction order is the same whatever shares its batch. One split writes
  the output directly; more write fp32 partials that `_reduce_splits_kernel` merges. When
  num_tokens <= num_seqs the prefill launch is skipped and this one (ALL_DECODE) also covers a
  q_len > 1 sequence, possible only next to q_len == 0 ones, token by token.
A decode therefore always takes the decode path and a prefill the other, whatever the batch mix.
Nothing here reads a device value on the host, so CUDA graphs can capture the launches.
"""
from __future__ import annotations

import torch
import triton

from cb_kernels.triton.paged_attention_kernels import (_paged_attention_kernel,
                                                       _reduce_splits_kernel)

# Decode splits: at least SPLIT_MIN keys each, at most MAX_SPLITS per sequence. 256 keys of a
# 128-dim bf16 head are 64 KiB of K+V per kv head: enough bytes per program to hide latency, and a
# batch-1 4096-token decode with 8 kv heads still gets 8 x 16 = 128 programs (~1 per H200 SM).
SPLIT_MIN = 256
MAX_SPLITS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiles(group: int, head_dim_pad: int, is_decode: bool, on_gpu: bool,
           fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) for one launch.

    tl.dot needs every dimension >= 16 on GPU, so a decode tile has at least 16 rows even when
    the group is smaller (the spare rows are masked). Prefill tiles take 64 rows (BLOCK_Q tokens x
    GROUP heads). Sizes were checked by compiling for sm_90 without a GPU (triton.compile +
    cuobjdump -res-usage, see test_triton_kernel_compiles_for_sm90_without_spills): bf16 decode
    with head_dim 128 and group 8 takes 225 registers at 64-key tiles and 136-159 at 32 (more
    programs per SM for a bandwidth-bound loop); bf16/fp16 prefill uses 183-228 and no stack for
    head_dim 64..256; fp32 (tf32x3 dots) spilled at 64x64 tiles and needs 32x32 (<= 253 regs).
    Under the interpreter each tile step costs Python overhead, so tiles are as wide as allowed.
    """
    if not on_gpu:
        block_m, tile_n = (16 if is_decode else 64), 64
    elif fp32:
        block_m, tile_n = (16 if is_decode else 32), 32
    elif is_decode:
        block_m, tile_n = 16, 32
    else:
        block_m, tile_n = 64, (64 if head_dim_pad <= 128 else 32)
    block_m = max(block_m, _next_pow2(group))
    block_q = 1 if is_decode else block_m // group
    return block_m, block_q, tile_n


def _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
            softcap, is_decode: bool, sinks=None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_pad = _next_pow2(head_dim)
    on_gpu = q.device.type == "cuda"
    fp32 = q.dtype == torch.float32
    block_m, block_q, tile_n = _tiles(group, head_dim_pad, is_decode, on_gpu, fp32)
    use_window = sliding_window is not None
    if is_decode:
        span = max_blocks * block_size
        if use_window:
            span = min(span, sliding_window)
        num_splits_bound = max(1, min(MAX_SPLITS, triton.cdiv(span, SPLIT_MIN)))
        grid = (num_seqs, num_kv_heads, num_splits_bound)
    else:
        num_splits_bound = 1
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, 1)
    if num_splits_bound > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits_bound, head_dim),
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits_bound, 2), dtype=torch.float32,
                              device=q.device)
    else:
        part_out = part_ml = out  # never written: every decode sequence has a single split
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, USE_WINDOW=use_window,
                  TILE_N=tile_n, SPLIT_MIN=SPLIT_MIN, MAX_SPLITS=MAX_SPLITS,
                  USE_SINKS=sinks is not None)
    sinks_arg = sinks if sinks is not None else seq_lens   # never read without USE_SINKS
    window = sliding_window if use_window else 0
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, part_out, part_ml,
        sinks_arg, num_seqs, num_heads, num_splits_bound, float(scale),
        float(softcap) if softcap is not None else 0.0, window,
        *q.stride(), *k_cache.stride()[:4], *v_cache.stride()[:4], *out.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        IS_DECODE=is_decode, ALL_DECODE=is_decode and num_tokens <= num_seqs,
        USE_SOFTCAP=softcap is not None,
        # The interpreter multiplies bf16 bit patterns in tl.dot, so it gets fp32 operands; on
        # GPU fp16/bf16 stay native (tensor cores); fp32 takes tf32x3 (three tf32 products, near
        # fp32 accuracy) since plain tf32 loses ~3 digits and "ieee" spilled 7 KB of stack.
        DOT_FP32=not on_gpu, DOT_PRECISION="tf32x3" if fp32 else "tf32",
        num_warps=4 if head_dim_pad <= 128 else 8, **common)
    if num_splits_bound > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, seq_lens, cu_seqlens_q, part_out, part_ml, sinks_arg, num_heads,
            num_splits_bound, window,
            *out.stride(), SPLITS_PAD=_next_pow2(num_splits_bound), **common)


def paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   out, scale, sliding_window, softcap, sinks=None) -> None:
    """Attention for the sequences with q_len > 1 only (the CUDA backend's prefill path)."""
    if q.shape[0] > block_tables.shape[0]:
        _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                sliding_window, softcap, is_decode=False, sinks=sinks)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                           sliding_window, softcap, sinks=None) -> None:
    """Writes attention of every query token into out. Arguments are validated by
    cb_kernels.ops.paged_attention (shapes in this module's docstring); `sliding_window` and
    `softcap` are None or positive numbers; `sinks` None or fp32 [num_heads] sink logits.
    """
    if block_tables.shape[0] == 0 or q.shape[0] == 0:
        return
    # At num_tokens <= num_seqs the batch is (almost surely) all decodes and the prefill launch
    # is skipped; the decode launch then also covers any sequence with q_len > 1 (ALL_DECODE),
    # e.g. q_lens [0, 0, 0, 1, 3], where testing num_tokens == num_seqs left the 3 rows unwritten.
    # Shapes only: no host read of device values.
    paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
                                   scale, sliding_window, softcap, sinks)
    _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
            softcap, is_decode=True, sinks=sinks)
