"""Triton short causal conv1d with its state (ops.causal_conv1d): one program per (row, block of
BLOCK_C channels). Channels never interact: the program walks the row's tokens, each output the
bias then the WIDTH taps oldest first (the CPU body's order), a tap before the row's first token
read from the slot's old window (zeros when the row starts afresh); the sum rounded to x's
dtype, then the SiLU in fp32. Then the slot's new window, the row's last STATE_LEN inputs (older
ones from the old window), is gathered whole and written after a barrier: the old window it
overwrites is the one the outputs and the gather read. A row's program never reads another
row's slot or tokens, so results do not depend on the batch. Runs on GPU, and on CPU tensors
under TRITON_INTERPRET=1 (slowly: tests keep it small).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv1d_kernel(
    p_x, p_weight, p_bias, p_state, p_out, p_slots, p_cu_seqlens, p_has_state,
    s_x_t,                       # elements between tokens of x (channels packed)
    CHANNELS: tl.constexpr, WIDTH: tl.constexpr, STATE_LEN: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    # x: [num_tokens, CHANNELS]; weight: [CHANNELS, WIDTH]; bias: [CHANNELS]; state:
    # [num_slots, CHANNELS, STATE_LEN] (x's dtype); out: [num_tokens, CHANNELS], packed;
    # slots int64, cu_seqlens int32, has_state u8 [num_seqs].
    i_s = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    t0 = tl.load(p_cu_seqlens + i_s).to(tl.int64)
    t1 = tl.load(p_cu_seqlens + i_s + 1).to(tl.int64)
    slot = tl.load(p_slots + i_s)
    has_state = tl.load(p_has_state + i_s).to(tl.int64)

    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < CHANNELS
    # Masks as [BLOCK_C] vectors: the interpreter refuses a scalar one.
    o_zero = tl.zeros([BLOCK_C], dtype=tl.int64)
    m_keep = m_c & (o_zero + has_state != 0)    # a row that starts afresh reads no old window
    p_win = p_state + (slot * CHANNELS + o_c) * STATE_LEN       # [BLOCK_C] window starts
    if HAS_BIAS:
        b_bias = tl.load(p_bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t in range(t0, t1):
        b_acc = b_bias
        for k in tl.static_range(WIDTH):
            pos = t - (WIDTH - 1) + k
            from_x = pos >= t0
            # Before the row: the old window's entry STATE_LEN - (t0 - pos) (>= 0: STATE_LEN >=
            # WIDTH - 1, checked). Indices of the side not read are clamped in range.
            i_x = tl.where(from_x, pos, t0)
            i_w = tl.where(from_x, 0, STATE_LEN - (t0 - pos))
            b_in = tl.load(p_x + i_x * s_x_t + o_c, mask=m_c & (o_zero + pos >= t0), other=0.0)
            b_old = tl.load(p_win + i_w, mask=m_keep & (o_zero + pos < t0), other=0.0)
            b_w = tl.load(p_weight + o_c * WIDTH + k, mask=m_c, other=0.0).to(tl.float32)
            b_acc = b_acc + b_w * (b_in.to(tl.float32) + b_old.to(tl.float32))
        b_y = b_acc.to(p_out.dtype.element_ty).to(tl.float32)      # the conv in x's dtype
        if SILU:
            b_y = b_y / (1.0 + tl.exp(-b_y))
        tl.store(p_out + t * CHANNELS + o_c, b_y.to(p_out.dtype.element_ty), mask=m_c)

    # The new window [BLOCK_C, BLOCK_L]: entry l is input t1 - STATE_LEN + l, from x inside the
    # row, else the old window's entry l + (t1 - t0), or zero when the row starts afresh.
    o_l = tl.arange(0, BLOCK_L)
    m_l = o_l < STATE_LEN
    o_pos = t1 - STATE_LEN + o_l
    m_x = o_pos >= t0
    o_x = tl.where(m_x, o_pos, 0)
    o_w = tl.where(m_x, 0, o_l + (t1 - t0))
    m_cl = m_c[:, None] & m_l[None, :]
    b_tail = tl.load(p_x + o_x[None, :] * s_x_t + o_c[:, None], mask=m_cl & m_x[None, :],
                     other=0.0)
    m_kept = m_keep[:, None] & (m_l & (o_pos < t0))[None, :]
    b_kept = tl.load(p_win[:, None] + o_w[None, :], mask=m_kept, other=0.0)
    b_new = tl.where(m_x[None, :], b_tail, b_kept)
    # Every load of the old window above comes before any thread overwrites it.
    tl.debug_barrier()
    tl.store(p_win[:, None] + o_l[None, :], b_new, mask=m_cl)


def causal_conv1d_triton(x, weight, bias, conv_state, slots, cu_seqlens, has_state, out,
                         silu: bool) -> None:
    """Arguments as ops.causal_conv1d's, checked there; writes `out` ([num_tokens, channels],
    contiguous) and `conv_state`."""
    num_seqs = slots.shape[0]
    channels, width = weight.shape
    state_len = conv_state.shape[2]
    if num_seqs == 0:
        return
    block_c = block_channels(channels)
    grid = (num_seqs, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, weight if bias is None else bias, conv_state, out, slots, cu_seqlens,
        has_state.view(torch.uint8), x.stride(0),
        CHANNELS=channels, WIDTH=width, STATE_LEN=state_len, BLOCK_C=block_c,
        BLOCK_L=triton.next_power_of_2(max(state_len, 1)), HAS_BIAS=bias is not None,
        SILU=bool(silu), num_warps=block_c // 32)


def block_channels(channels: int) -> int:
    """BLOCK_C: 32 to 128 channels, one per thread of BLOCK_C // 32 warps (the op moves ~width x 2
    values an output, so it is memory-bound; wider blocks only cut the programs a decode step
    has)."""
    return min(128, max(32, triton.next_power_of_2(channels)))
