"""Triton write_kv: one program per token stores its [num_kv_heads, head_dim] K and V tiles into
the token's cache slot (slot -1 stores nothing). Runs on GPU, and on CPU tensors under
TRITON_INTERPRET=1."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    p_key, p_value, p_k_cache, p_v_cache, p_slot_mapping,
    block_size,
    s_key_t, s_key_h, s_value_t, s_value_h,
    s_kc_b, s_kc_o, s_kc_h, s_vc_b, s_vc_o, s_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(p_slot_mapping + i_t)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    # slot -1 masks every lane, so the program stores nothing (and reads nothing). The slot is
    # broadcast to the tile first: the interpreter rejects a mask built from a scalar bool.
    m_slot = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0
    m_hd = (o_h[:, None] < NUM_KV_HEADS) & (o_d[None, :] < HEAD_DIM) & m_slot
    i_block = slot // block_size
    i_off = slot % block_size

    p_k = p_key + i_t * s_key_t + o_h[:, None] * s_key_h + o_d[None, :]
    p_v = p_value + i_t * s_value_t + o_h[:, None] * s_value_h + o_d[None, :]
    b_k = tl.load(p_k, mask=m_hd)
    b_v = tl.load(p_v, mask=m_hd)
    p_kc = p_k_cache + i_block * s_kc_b + i_off * s_kc_o + o_h[:, None] * s_kc_h + o_d[None, :]
    p_vc = p_v_cache + i_block * s_vc_b + i_off * s_vc_o + o_h[:, None] * s_vc_h + o_d[None, :]
    tl.store(p_kc, b_k, mask=m_hd)
    tl.store(p_vc, b_v, mask=m_hd)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Checked arguments only (cb_kernels.ops.write_kv checks them).

    key, value: [num_tokens, num_kv_heads, head_dim], head_dim stride 1; k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim], head_dim stride 1; slot_mapping: int64
    [num_tokens]. Strides are in elements.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
