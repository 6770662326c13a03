"""Triton Mamba-2 selective scan (the recurrence of ops.selective_scan): one program per (row,
head, block of BLOCK_P state rows). The program holds its [BLOCK_P, d_state] fp32 state tile in
registers and walks the row's tokens one by one: dt' (bias, softplus, clamp), the decay, the
rank-1 write dt' x B^T, the read S C plus D x. State rows never interact, so the tiles are exact
pieces of the whole, and a row's program never reads another row: results do not depend on the
batch. No tl.dot (every sum is over d_state of one token), so bf16 inputs are widened to fp32
on load. Runs on GPU, and on CPU tensors under TRITON_INTERPRET=1 (slowly: tests keep it small).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(v):
    # log1p(exp(v)), v itself above 20 (torch's threshold, as the CPU body). log1p(u) as
    # log(1 + u) * u / ((1 + u) - 1) (exact to a few ulp; tl has no log1p the interpreter runs):
    # plain log(1 + u) loses u's low bits, 1e-3 relative at v = -10.
    u = tl.exp(v)
    w = 1.0 + u
    l1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(v > 20.0, v, l1p)


@triton.jit
def _selective_scan_kernel(
    p_x, p_dt, p_A, p_B, p_C, p_D, p_dt_bias, p_state, p_out, p_slots, p_cu_seqlens, p_has_state,
    s_x_t, s_b_t, s_c_t,         # elements between tokens of x, B, C (the rest is packed)
    dt_lo, dt_hi,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, D_STATE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
):
    # x, out: [num_tokens, NUM_HEADS, HEAD_DIM]; dt: fp32 [num_tokens, NUM_HEADS]; A, D,
    # dt_bias: fp32 [NUM_HEADS]; B, C: [num_tokens, num_groups, D_STATE]; state: fp32
    # [num_slots, NUM_HEADS, HEAD_DIM, D_STATE]; slots int64, cu_seqlens int32, has_state u8.
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_p = tl.program_id(2).to(tl.int64)
    i_g = i_h // GROUP
    t0 = tl.load(p_cu_seqlens + i_s).to(tl.int64)
    t1 = tl.load(p_cu_seqlens + i_s + 1).to(tl.int64)
    slot = tl.load(p_slots + i_s)
    has_state = tl.load(p_has_state + i_s).to(tl.int32)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < HEAD_DIM
    m_n = o_n < D_STATE
    m_pn = m_p[:, None] & m_n[None, :]
    p_s = p_state + ((slot * NUM_HEADS + i_h) * HEAD_DIM + o_p[:, None]) * D_STATE + o_n[None, :]
    # A row that starts afresh reads nothing from its slot (it may hold another row's state).
    b_keep = (tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int32) + has_state) != 0
    b_s = tl.load(p_s, mask=m_pn & b_keep, other=0.0)

    b_a = tl.load(p_A + i_h)
    b_d = tl.load(p_D + i_h) if HAS_D else 0.0
    b_dt_bias = tl.load(p_dt_bias + i_h) if HAS_DT_BIAS else 0.0
    for t in range(t0, t1):
        b_dt = tl.load(p_dt + t * NUM_HEADS + i_h) + b_dt_bias
        if SOFTPLUS:
            b_dt = _softplus(b_dt)
        if CLAMP:
            b_dt = tl.minimum(tl.maximum(b_dt, dt_lo), dt_hi)
        b_decay = tl.exp(b_dt * b_a)
        b_x = tl.load(p_x + t * s_x_t + i_h * HEAD_DIM + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_b = tl.load(p_B + t * s_b_t + i_g * D_STATE + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_c = tl.load(p_C + t * s_c_t + i_g * D_STATE + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_s = b_s * b_decay + (b_dt * b_x)[:, None] * b_b[None, :]
        b_y = tl.sum(b_s * b_c[None, :], axis=1) + b_d * b_x
        p_o = p_out + (t * NUM_HEADS + i_h) * HEAD_DIM + o_p
        tl.store(p_o, b_y.to(p_out.dtype.element_ty), mask=m_p)
    tl.store(p_s, b_s, mask=m_pn)


def tile_sizes(head_dim: int, d_state: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N): a program's [BLOCK_P, BLOCK_N] fp32 state tile in registers. 32 x 128
    is 16 KiB a program (4 warps), as the gated delta rule's tile: 128 registers a thread and no
    spills on sm_90 (triton 3.9, cuobjdump; tests/ops/test_selective_scan.py checks it)."""
    block_n = triton.next_power_of_2(d_state)
    return min(triton.next_power_of_2(head_dim), max(4, 4096 // block_n)), block_n


def selective_scan_triton(x, dt, A, B, C, state, slots, cu_seqlens, has_state, out, D, dt_bias,
                          dt_softplus: bool, dt_lo: float, dt_hi: float) -> None:
    """Arguments as ops.selective_scan's, checked there; `dt_hi <= dt_lo` means no clamp (the
    CPU body's convention). Writes `out` ([num_tokens, num_heads, head_dim], contiguous) and
    `state`."""
    num_seqs = slots.shape[0]
    num_heads, head_dim = x.shape[1], x.shape[2]
    num_groups, d_state = B.shape[1], B.shape[2]
    if num_seqs == 0:
        return
    block_p, block_n = tile_sizes(head_dim, d_state)
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    _selective_scan_kernel[grid](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, state, out,
        slots, cu_seqlens, has_state.view(torch.uint8),
        x.stride(0), B.stride(0), C.stride(0), float(dt_lo), float(dt_hi),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, GROUP=num_heads // num_groups, D_STATE=d_state,
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus), CLAMP=dt_hi > dt_lo)
