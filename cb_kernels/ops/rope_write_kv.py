"""`rope_write_kv_`: the rotary embedding of q and k in place, then k and v into their cache slots,
in one C++ pass (float32 or bfloat16, CPU). It is `rope_(q)`, `rope_(k)` and `write_kv(k, v, ...)`
with the same bits (tests), for the fused forward: three calls a layer become one, which saved
their per-call cost (argument checks, dispatch, one pass over the rows each).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops import rope as _rope
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops._cache_checks import check_slot_values, check_write_kv


def rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *, isa: str = "auto") -> None:
    """Rotate q and k in place (as `rope_`), then write k and v into their cache slots (as
    `write_kv`: slot -1 skips a token; a slot outside the pool or written twice raises).

    Parameters
    ----------
    q : float32 or bfloat16 CPU [num_tokens, num_heads, head_dim], head_dim even and packed.
    k, v : [num_tokens, num_kv_heads, head_dim] of q's dtype, head_dim packed (views into a
        fused qkv output work).
    cos, sin : contiguous [num_tokens, head_dim] of q's dtype.
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim] of q's dtype, head_dim packed.
    slot_mapping : int64 [num_tokens]; slot = block * block_size + offset.
    isa : caps the kernel's body ("auto" or one of ``_C.cpu_isas()``, for tests).
    """
    check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    check_slot_values(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    if torch.compiler.is_compiling():   # traced: the registered op (its fake reads no values)
        torch.ops.cb_kernels.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    else:
        run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, isa)


def rope_write_kv_unchecked(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *,
                            check_metadata: bool = False) -> None:
    """The engine's hot path: `rope_write_kv_` without the slot-value check (the engine checks
    slots on the host, runner/step_inputs.py) and, unless `check_metadata`, without the shape,
    stride and dtype checks: the fused forward checks them on layer 0, whose tensors have the
    shapes of every layer's. The kernel skips slots outside the pool in any case, so a bad value
    drops a token but never writes outside the caches."""
    if check_metadata:
        check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if torch.compiler.is_compiling():
        torch.ops.cb_kernels.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    else:
        run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """The metadata checks of `rope_write_kv_` (no values read); errors name the argument."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype:
            raise TypeError(f"{name} must be a tensor of q's dtype {q.dtype}, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    _rope._check(q, cos, sin)
    if k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k is {list(k.shape)} but q is {list(q.shape)}: k must be [num_tokens, "
                         "num_kv_heads, head_dim] with q's tokens and head_dim")
    _rope._check(k, cos, sin)
    check_write_kv(k, v, k_cache, v_cache, slot_mapping)
    if k_cache.device.type != "cpu":
        raise ValueError(f"rope_write_kv_ runs on CPU tensors, got the caches on {k_cache.device}")


def run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, isa: str = "auto") -> None:
    sync_threads()
    _C.rope_write_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
                     q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                     (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)),
                     (v.stride(0), v.stride(1)), k_cache.stride()[:3], v_cache.stride()[:3],
                     k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1], isa, DTYPE_CODES[q.dtype])


@torch.library.custom_op("cb_kernels::rope_write_kv_",
                         mutates_args=("q", "k", "k_cache", "v_cache"))
def _rope_write_kv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    check_slot_values(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    run(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


@_rope_write_kv_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
