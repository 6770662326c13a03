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
  the output directly; more write fp32 partials that `_reduce_splits_kernel` merges.
A decode therefore always takes the decode path and a prefill the other, whatever the batch mix.
Nothing here reads a device value on the host, so CUDA graphs can capture the launches.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Decode splits: at least SPLIT_MIN keys each, at most MAX_SPLITS per sequence. 256 keys of a
# 128-dim bf16 head are 64 KiB of K+V per kv head: enough bytes per program to hide latency, and a
# batch-1 4096-token decode with 8 kv heads still gets 8 x 16 = 128 programs (~1 per H200 SM).
SPLIT_MIN = 256
MAX_SPLITS = 32


@triton.jit
def _decode_splits(seq_len, window, USE_WINDOW: tl.constexpr, TILE_N: tl.constexpr,
                   SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Key range [lo, seq_len) of a decode query, its split count and keys per split."""
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    span = seq_len - lo
    num_splits = tl.maximum(tl.minimum(tl.cdiv(span, SPLIT_MIN), MAX_SPLITS), 1)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), TILE_N) * TILE_N, TILE_N)
    num_splits = tl.maximum(tl.cdiv(span, split_len), 1)   # rounding up may empty the last ones
    return lo, num_splits, split_len


@triton.jit
def _attend_rows(q_ptr, tok, head, m_row, pos_q, lo, hi, p_bt, k_ptr, v_ptr, i_kvh, scale, softcap,
                 window, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh,
                 stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                 TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of BLOCK_M query rows (token tok, head head, position pos_q; m_row marks
    real rows) over keys lo..hi-1 of kv head i_kvh. Returns the unnormalised fp32 acc
    [BLOCK_M, HEAD_DIM_PAD], the row max (log2 units) and the row sum.
    """
    o_d = tl.arange(0, HEAD_DIM_PAD)
    o_n = tl.arange(0, TILE_N)
    m_d = o_d < HEAD_DIM
    p_q = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, TILE_N):
        pos = start + o_n
        m_key = pos < hi
        # Masked loads keep unused slots (possibly NaN) and stale block-table entries out.
        blk = tl.load(p_bt + pos // BLOCK_SIZE, mask=m_key, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        m_kv = m_key[:, None] & m_d[None, :]
        p_k = (k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_kt + i_kvh * stride_kh
               + o_d[None, :] * stride_kd)
        b_k = tl.load(p_k, mask=m_kv, other=0.0)
        if DOT_FP32:
            b_k = b_k.to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        if USE_SOFTCAP:
            # c * tanh(s / c) with tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both infinities.
            b_s = b_s * (scale / softcap)
            b_s = softcap * (1.0 - 2.0 / (tl.exp2(b_s * (2.0 * LOG2E)) + 1.0)) * LOG2E
        else:
            b_s = b_s * (scale * LOG2E)
        m_s = m_row[:, None] & m_key[None, :] & (pos[None, :] <= pos_q[:, None])
        if USE_WINDOW:
            m_s = m_s & (pos[None, :] > pos_q[:, None] - window)
        b_s = tl.where(m_s, b_s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # row fully masked so far
        b_p = tl.where(m_s, tl.exp2(b_s - m_safe[:, None]), 0.0)
        alpha = tl.exp2(b_m - m_safe)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        p_v = (v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vt + i_kvh * stride_vh
               + o_d[None, :] * stride_vd)
        b_v = tl.load(p_v, mask=m_kv, other=0.0)
        if DOT_FP32:
            b_v = b_v.to(tl.float32)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v,
                                                input_precision=DOT_PRECISION)
        b_m = m_new
    return b_acc, b_m, b_l


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, part_out_ptr, part_ml_ptr,
        num_seqs, num_heads, num_splits_bound, scale, softcap, window,
        stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        IS_DECODE: tl.constexpr, ALL_DECODE: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr,
        DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_kvh = tl.program_id(1)
    if IS_DECODE:
        i_seq = tl.program_id(0)
        i_split = tl.program_id(2)
        i_qblock = 0
    else:
        # The sequence owning q-block program_id(0): the last s with cu_q[s] // BLOCK_Q + s <= pid.
        pid = tl.program_id(0)
        lo_s = 0
        hi_s = num_seqs - 1
        while lo_s < hi_s:
            mid = (lo_s + hi_s + 1) // 2
            first = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
            lo_s = tl.where(first <= pid, mid, lo_s)
            hi_s = tl.where(first <= pid, hi_s, mid - 1)
        i_seq = lo_s
        i_qblock = pid - (tl.load(cu_q_ptr + i_seq) // BLOCK_Q + i_seq)
        i_split = 0

    q_start = tl.load(cu_q_ptr + i_seq)
    q_len = tl.load(cu_q_ptr + i_seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + i_seq)
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_d = o_d < HEAD_DIM
    head = (i_kvh * GROUP + o_m % GROUP).to(tl.int64)
    p_bt = bt_ptr + i_seq.to(tl.int64) * stride_bt
    if IS_DECODE:
        # q_len == 1: split i_split of the token's keys. With ALL_DECODE (no prefill launch, as
        # num_tokens == num_seqs) a sequence with q_len > 1 (possible only when another has none)
        # is covered here too: its tokens i_split, i_split + bound, ..., each over all its keys.
        lo_d, num_splits, split_len = _decode_splits(seq_len, window, USE_WINDOW, TILE_N,
                                                     SPLIT_MIN, MAX_SPLITS)
        t_end = tl.where((q_len == 1) & (i_split < num_splits), 1, 0)
        if ALL_DECODE:
            t_end = tl.where(q_len > 1, q_len, t_end)
        partial = (q_len == 1) & (num_splits > 1)
        for t in range(tl.where(q_len == 1, 0, i_split), t_end, num_splits_bound):
            pos_t = seq_len - q_len + t
            lo = 0
            if USE_WINDOW:
                lo = tl.maximum(pos_t - window + 1, 0)
            lo = tl.where(q_len == 1, lo_d + i_split * split_len, lo)
            hi = tl.where(q_len == 1, tl.minimum(seq_len, lo + split_len), pos_t + 1)
            m_row = o_m < GROUP
            tok = tl.zeros([BLOCK_M], tl.int64) + (q_start + t)
            pos_q = tl.zeros([BLOCK_M], tl.int32) + pos_t
            b_acc, b_m, b_l = _attend_rows(
                q_ptr, tok, head, m_row, pos_q, lo, hi, p_bt, k_ptr, v_ptr, i_kvh, scale,
                softcap, window, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh,
                stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                BLOCK_SIZE, BLOCK_M, TILE_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32, DOT_PRECISION)
            m_out = m_row[:, None] & m_d[None, :]
            if partial:
                row = (i_seq.to(tl.int64) * num_heads + head) * num_splits_bound + i_split
                tl.store(part_out_ptr + row[:, None] * HEAD_DIM + o_d[None, :], b_acc, mask=m_out)
                tl.store(part_ml_ptr + row * 2, b_m, mask=m_row)
                tl.store(part_ml_ptr + row * 2 + 1, b_l, mask=m_row)
            else:
                _store_out(out_ptr, tok, head, b_acc, b_l, m_out, stride_ot, stride_oh, stride_od,
                           HEAD_DIM_PAD)
    else:
        if (q_len > 1) & (i_qblock * BLOCK_Q < q_len):
            q_tok = i_qblock * BLOCK_Q + o_m // GROUP    # index among this sequence's q tokens
            m_row = (o_m < BLOCK_Q * GROUP) & (q_tok < q_len)
            pos_q = seq_len - q_len + q_tok               # absolute position of each row's query
            lo = 0
            if USE_WINDOW:
                lo = tl.maximum(seq_len - q_len + i_qblock * BLOCK_Q - window + 1, 0)
            hi = seq_len - q_len + tl.minimum((i_qblock + 1) * BLOCK_Q, q_len)
            tok = (q_start + q_tok).to(tl.int64)
            b_acc, b_m, b_l = _attend_rows(
                q_ptr, tok, head, m_row, pos_q, lo, hi, p_bt, k_ptr, v_ptr, i_kvh, scale,
                softcap, window, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh,
                stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                BLOCK_SIZE, BLOCK_M, TILE_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32, DOT_PRECISION)
            _store_out(out_ptr, tok, head, b_acc, b_l, m_row[:, None] & m_d[None, :], stride_ot,
                       stride_oh, stride_od, HEAD_DIM_PAD)


@triton.jit
def _store_out(out_ptr, tok, head, b_acc, b_l, m_out, stride_ot, stride_oh, stride_od,
               HEAD_DIM_PAD: tl.constexpr):
    o_d = tl.arange(0, HEAD_DIM_PAD)
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    p_o = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _reduce_splits_kernel(out_ptr, seq_lens_ptr, cu_q_ptr, part_out_ptr, part_ml_ptr, num_heads,
                          num_splits_bound, window, stride_ot, stride_oh, stride_od,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
                          TILE_N: tl.constexpr, SPLIT_MIN: tl.constexpr,
                          MAX_SPLITS: tl.constexpr):
    """Merge the decode splits of one (sequence, head) in split order into out."""
    i_seq = tl.program_id(0)
    i_head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + i_seq)
    if tl.load(cu_q_ptr + i_seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + i_seq)
    _, num_splits, _ = _decode_splits(seq_len, window, USE_WINDOW, TILE_N, SPLIT_MIN, MAX_SPLITS)
    if num_splits == 1:
        return
    o_s = tl.arange(0, SPLITS_PAD)
    o_d = tl.arange(0, HEAD_DIM_PAD)
    m_s = o_s < num_splits
    row = (i_seq.to(tl.int64) * num_heads + i_head) * num_splits_bound + o_s
    b_m = tl.load(part_ml_ptr + row * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(part_ml_ptr + row * 2 + 1, mask=m_s, other=0.0)
    m_max = tl.max(b_m, 0)
    b_w = tl.where(m_s & (b_m > float("-inf")), tl.exp2(b_m - m_max), 0.0)
    b_acc = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + o_d[None, :],
                    mask=m_s[:, None] & (o_d < HEAD_DIM)[None, :], other=0.0)
    b_o = tl.sum(b_acc * b_w[:, None], 0) / tl.sum(b_l * b_w, 0)
    p_o = out_ptr + q_start.to(tl.int64) * stride_ot + i_head * stride_oh + o_d * stride_od
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=o_d < HEAD_DIM)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiles(group: int, head_dim_pad: int, is_decode: bool, on_gpu: bool,
           fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) for one launch.

    tl.dot needs every dimension >= 16 on GPU, so a decode tile has at least 16 rows even when
    the group is smaller (the spare rows are masked). Prefill tiles take 64 rows (BLOCK_Q tokens x
    GROUP heads). Sizes were checked by compiling for sm_90 without a GPU (triton.compile +
    cuobjdump -res-usage): bf16/fp16 at these tiles use 98-206 registers and no stack for head_dim
    64..256; fp32 (tf32x3 dots) spilled at 64x64 tiles and needs 32x32 (191-253 regs, no stack).
    Under the interpreter each tile step costs Python overhead, so tiles are as wide as allowed.
    """
    if not on_gpu:
        block_m, tile_n = (16 if is_decode else 64), 64
    elif fp32:
        block_m, tile_n = (16 if is_decode else 32), 32
    else:
        block_m, tile_n = (16 if is_decode else 64), (64 if head_dim_pad <= 128 else 32)
    block_m = max(block_m, _next_pow2(group))
    block_q = 1 if is_decode else block_m // group
    return block_m, block_q, tile_n


def _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
            softcap, is_decode: bool) -> None:
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
                  TILE_N=tile_n, SPLIT_MIN=SPLIT_MIN, MAX_SPLITS=MAX_SPLITS)
    window = sliding_window if use_window else 0
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, part_out, part_ml,
        num_seqs, num_heads, num_splits_bound, float(scale),
        float(softcap) if softcap is not None else 0.0, window,
        *q.stride(), *k_cache.stride()[:4], *v_cache.stride()[:4], *out.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        IS_DECODE=is_decode, ALL_DECODE=is_decode and num_tokens == num_seqs,
        USE_SOFTCAP=softcap is not None,
        # The interpreter multiplies bf16 bit patterns in tl.dot, so it gets fp32 operands; on
        # GPU fp16/bf16 stay native (tensor cores); fp32 takes tf32x3 (three tf32 products, near
        # fp32 accuracy) since plain tf32 loses ~3 digits and "ieee" spilled 7 KB of stack.
        DOT_FP32=not on_gpu, DOT_PRECISION="tf32x3" if fp32 else "tf32",
        num_warps=4 if head_dim_pad <= 128 else 8, **common)
    if num_splits_bound > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, seq_lens, cu_seqlens_q, part_out, part_ml, num_heads, num_splits_bound, window,
            *out.stride(), SPLITS_PAD=_next_pow2(num_splits_bound), **common)


def paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   out, scale, sliding_window, softcap) -> None:
    """Attention for the sequences with q_len > 1 only (the CUDA backend's prefill path)."""
    if q.shape[0] > block_tables.shape[0]:
        _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                sliding_window, softcap, is_decode=False)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                           sliding_window, softcap) -> None:
    """Writes attention of every query token into out. Arguments are validated by
    cb_kernels.ops.paged_attention (shapes in this module's docstring); `sliding_window` and
    `softcap` are None or positive numbers.
    """
    if block_tables.shape[0] == 0 or q.shape[0] == 0:
        return
    # At num_tokens == num_seqs the batch is (almost surely) all decodes and the prefill launch
    # is skipped; the decode launch then also covers any sequence with q_len > 1 (ALL_DECODE).
    # Shapes only: no host read of device values.
    paged_attention_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
                                   scale, sliding_window, softcap)
    _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
            softcap, is_decode=True)
