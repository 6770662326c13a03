"""Triton kernels of paged attention; cb_kernels/triton/paged_attention.py launches them and
documents the layouts, grids and the split rule."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


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
        sinks_ptr, num_seqs, num_heads, num_splits_bound, scale, softcap, window,
        stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        IS_DECODE: tl.constexpr, ALL_DECODE: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, SPLIT_MIN: tl.constexpr, MAX_SPLITS: tl.constexpr,
        DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_SINKS: tl.constexpr):
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
        # num_tokens <= num_seqs) a sequence with q_len > 1 (possible only when another has none)
        # is covered here too: its tokens i_split, i_split + bound, ..., each over all its keys.
        lo_d, num_splits, split_len = _decode_splits(seq_len, window, USE_WINDOW, TILE_N,
                                                     SPLIT_MIN, MAX_SPLITS)
        # Only a seq_len beyond the block table (unchecked on device) could exceed the grid.
        num_splits = tl.minimum(num_splits, num_splits_bound)
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
                _store_out(out_ptr, tok, head, b_acc, b_m, b_l, m_out, m_row, sinks_ptr,
                           stride_ot, stride_oh, stride_od, HEAD_DIM_PAD, USE_SINKS)
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
            _store_out(out_ptr, tok, head, b_acc, b_m, b_l, m_row[:, None] & m_d[None, :], m_row,
                       sinks_ptr, stride_ot, stride_oh, stride_od, HEAD_DIM_PAD, USE_SINKS)


@triton.jit
def _sink_term(sinks_ptr, head, b_m, m_row):
    """exp(sink - max) of each row, in the log2 units of b_m: the sink's share of the softmax
    denominator (its value row is zero, so the numerator does not change)."""
    b_sink = tl.load(sinks_ptr + head, mask=m_row, other=0.0) * LOG2E
    return tl.where(m_row & (b_m > float("-inf")), tl.exp2(b_sink - b_m), 0.0)


@triton.jit
def _store_out(out_ptr, tok, head, b_acc, b_m, b_l, m_out, m_row, sinks_ptr, stride_ot, stride_oh,
               stride_od, HEAD_DIM_PAD: tl.constexpr, USE_SINKS: tl.constexpr):
    o_d = tl.arange(0, HEAD_DIM_PAD)
    if USE_SINKS:
        b_l = b_l + _sink_term(sinks_ptr, head, b_m, m_row)
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    p_o = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :] * stride_od
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def _reduce_splits_kernel(out_ptr, seq_lens_ptr, cu_q_ptr, part_out_ptr, part_ml_ptr, sinks_ptr,
                          num_heads, num_splits_bound, window, stride_ot, stride_oh, stride_od,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, USE_WINDOW: tl.constexpr,
                          TILE_N: tl.constexpr, SPLIT_MIN: tl.constexpr,
                          MAX_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr):
    """Merge the decode splits of one (sequence, head) in split order into out."""
    i_seq = tl.program_id(0)
    i_head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + i_seq)
    if tl.load(cu_q_ptr + i_seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + i_seq)
    _, num_splits, _ = _decode_splits(seq_len, window, USE_WINDOW, TILE_N, SPLIT_MIN, MAX_SPLITS)
    num_splits = tl.minimum(num_splits, num_splits_bound)
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
    b_den = tl.sum(b_l * b_w, 0)
    if USE_SINKS:
        b_den += tl.exp2(tl.load(sinks_ptr + i_head) * LOG2E - m_max)
    b_o = tl.sum(b_acc * b_w[:, None], 0) / b_den
    p_o = out_ptr + q_start.to(tl.int64) * stride_ot + i_head * stride_oh + o_d * stride_od
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=o_d < HEAD_DIM)
