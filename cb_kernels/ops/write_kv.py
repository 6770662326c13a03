"""`write_kv`: scatter each new token's K and V into its cache slot, in place.

Layout (DESIGN.md): a layer's cache is [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset; slot -1 skips a token. The C++ and CUDA kernels move bytes, so one
kernel serves every dtype and results are bit-exact by construction.

Backends: "cpu" (csrc/cpu), "triton" (cb_kernels/triton/write_kv.py), "cuda" (csrc/cuda),
"torch" (`ref_write_kv` in ops/reference.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops import reference
from cb_kernels.ops._backend import default_cuda_backend, resolve_backend, sync_threads
from cb_kernels.ops._cache_checks import check_slot_values, check_write_kv

WRITE_KV_BACKENDS = ("cuda", "triton", "cpu", "torch")


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, backend=None) -> None:
    """Write each token's K and V into its cache slot, in place.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_dim], any strides with head_dim packed.
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], same dtype as key; any
        strides with head_dim packed (transformers' per-layer views work in place).
    slot_mapping : int64 [num_tokens] on the caches' device; -1 skips the token. Slots outside
        the pool or written twice raise ValueError; on CUDA that check costs one host sync (it is
        skipped while a CUDA graph is captured, and the kernels then skip out-of-pool slots).
    backend : None (fastest here), "cuda", "triton", "cpu" or "torch" (the reference).
    """
    if torch.compiler.is_compiling():
        torch.ops.cb_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping, backend)
    else:
        _write_kv(key, value, k_cache, v_cache, slot_mapping, backend)


def _write_kv(key, value, k_cache, v_cache, slot_mapping, backend) -> None:
    device = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    check_slot_values(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    chosen = resolve_backend(backend, device, WRITE_KV_BACKENDS, default_cuda_backend(WRITE_KV_BACKENDS), "write_kv")
    run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping)


def write_kv_unchecked(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    """The engine's hot path: `write_kv` without the slot-value check, so no host sync on CUDA.

    Shapes, dtypes, strides and devices are still checked (tensor metadata, free). The caller
    vouches for the slot values: the engine builds slot_mapping on the host from its own block
    tables and checks it there once per step (runner/step_inputs.py, `check_slots`), before the upload.
    The C++, CUDA and Triton kernels skip slots outside the pool in any case, so a bad value can
    drop a token but never write outside the caches. Same arguments as `write_kv`.
    """
    if torch.compiler.is_compiling():   # traced: the registered op (its fake reads no values)
        torch.ops.cb_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping, backend)
        return
    device = check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    chosen = resolve_backend(backend, device, WRITE_KV_BACKENDS, default_cuda_backend(WRITE_KV_BACKENDS), "write_kv")
    run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping)


def run_write_kv(chosen, key, value, k_cache, v_cache, slot_mapping) -> None:
    """Run one backend on checked arguments (also the body of the torch.library op)."""
    if key.shape[0] == 0:
        return
    if chosen == "torch":
        reference.ref_write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif chosen == "triton":
        from cb_kernels.triton.write_kv import triton_write_kv
        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        args = _write_kv_args(key, value, k_cache, v_cache, slot_mapping)
        if chosen == "cpu":
            sync_threads()
            _C.write_kv(*args)
        else:
            from cb_kernels.ops import _cuda_cache
            _cuda_cache.write_kv(args, key.device)


def _write_kv_args(key, value, k_cache, v_cache, slot_mapping) -> tuple:
    es = key.element_size()
    return (key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
            key.shape[0], key.shape[1], k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1], key.shape[2] * es,
            (key.stride(0) * es, key.stride(1) * es), (value.stride(0) * es, value.stride(1) * es),
            tuple(s * es for s in k_cache.stride()[:3]), tuple(s * es for s in v_cache.stride()[:3]))


# The torch.library op, so torch.compile and CUDA graphs can trace the call: the mutated caches
# are in the schema, and the fake checks shapes (slot values are data, checked at run time).
@torch.library.custom_op("cb_kernels::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, backend: Optional[str] = None) -> None:
    _write_kv(key, value, k_cache, v_cache, slot_mapping, backend)


@_write_kv_op.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    check_write_kv(key, value, k_cache, v_cache, slot_mapping)
