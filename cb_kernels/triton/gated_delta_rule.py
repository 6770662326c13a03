"""Triton gated delta rule (the recurrence of ops.gated_delta_rule): one program per (row, value
head, block of BLOCK_V state columns). The program holds its [k_dim, BLOCK_V] state tile in
registers and walks the row's tokens one by one: decay, k'^T S, the delta, the rank-1 update,
q'^T S. Columns of the state never interact, so the tiles are exact pieces of the whole. No
tl.dot (the sums are over k_dim of one token), so bf16 inputs are widened to fp32 on load.
Runs on GPU, and on CPU tensors under TRITON_INTERPRET=1 (slowly: tests keep it small)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_rule_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_state, p_out, p_slots, p_cu_seqlens, p_has_state,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    scale,
    NUM_V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):
    i_sh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1).to(tl.int64)
    i_s = i_sh // NUM_V_HEADS
    i_h = i_sh % NUM_V_HEADS
    i_kh = i_h // GROUP
    t0 = tl.load(p_cu_seqlens + i_s).to(tl.int64)
    t1 = tl.load(p_cu_seqlens + i_s + 1).to(tl.int64)
    slot = tl.load(p_slots + i_s)
    has_state = tl.load(p_has_state + i_s).to(tl.int32)

    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k = o_k < K_DIM
    m_v = o_v < V_DIM
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = p_state + ((slot * NUM_V_HEADS + i_h) * K_DIM + o_k[:, None]) * V_DIM + o_v[None, :]
    # A row that starts afresh reads nothing from its slot (it may hold another row's state).
    b_keep = (tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.int32) + has_state) != 0
    b_s = tl.load(p_s, mask=m_kv & b_keep, other=0.0).to(tl.float32)

    for t in range(t0, t1):
        b_q = tl.load(p_q + t * s_q_t + i_kh * s_q_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * s_k_t + i_kh * s_k_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q * scale
        b_v = tl.load(p_v + t * s_v_t + i_h * s_v_h + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + t * NUM_V_HEADS + i_h)
        b_beta = tl.load(p_beta + t * NUM_V_HEADS + i_h)
        b_s = b_s * tl.exp(b_g)
        b_d = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta
        b_s = b_s + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)
        p_o = p_out + (t * NUM_V_HEADS + i_h) * V_DIM + o_v
        tl.store(p_o, b_o.to(p_out.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s, mask=m_kv)


def gated_delta_rule_triton(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out,
                            scale: float, l2norm_qk: bool) -> None:
    """Arguments as ops.gated_delta_rule's, checked there; writes `out` and `state`."""
    num_seqs = slots.shape[0]
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    k_dim = q.shape[2]
    if num_seqs == 0:
        return
    block_k = triton.next_power_of_2(k_dim)
    # [block_k, block_v] fp32 in registers: 128 x 32 is 16 KiB a program (4 warps).
    block_v = min(triton.next_power_of_2(v_dim), max(16, 4096 // block_k))
    grid = (num_seqs * num_v_heads, triton.cdiv(v_dim, block_v))
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, slots, cu_seqlens, has_state.view(torch.uint8),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        float(scale),
        NUM_V_HEADS=num_v_heads, GROUP=num_v_heads // q.shape[1], K_DIM=k_dim, V_DIM=v_dim,
        BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=bool(l2norm_qk))
