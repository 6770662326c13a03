"""`copy_blocks`: copy block src to block dst inside one pool, every layer's K and V in one call
(the copy-on-write of a forked prefix).

Backends: "cpu" (csrc/cpu), "cuda" (csrc/cuda), "torch" (ops/_block_copy.py's pure-torch copy;
`ref_copy_blocks` in ops/reference.py is the tests' oracle).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from cb_kernels.ops._backend import default_cuda_backend, resolve_backend
from cb_kernels.ops._block_copy import run_block_copy
from cb_kernels.ops._cache_checks import Pool, check_block_mapping, check_pool_list, check_same_geometry

COPY_BLOCKS_BACKENDS = ("cuda", "cpu", "torch")


def copy_blocks(k_caches, v_caches, block_mapping, *, backend=None) -> None:
    """Copy block src to block dst in every layer's K and V cache (copy-on-write of prefix forks).

    Parameters
    ----------
    k_caches, v_caches : lists over layers of [num_blocks, block_size, num_kv_heads, head_dim]
        (any [num_blocks, ...] packed inside a block), all in one pool: same device and block count.
    block_mapping : int64 [n, 2] CPU tensor of (src, dst) block ids; destinations distinct and
        never also a source.
    backend : None, "cuda", "cpu" or "torch".
    """
    if torch.compiler.is_compiling():
        torch.ops.cb_kernels.copy_blocks(list(k_caches), list(v_caches), block_mapping, backend)
    else:
        _copy_blocks(k_caches, v_caches, block_mapping, backend)


def _check_copy_pool(k_caches, v_caches) -> Pool:
    k_pool = check_pool_list(k_caches, "k_caches")
    v_pool = check_pool_list(v_caches, "v_caches")
    check_same_geometry(k_pool.tensors, v_pool.tensors, "k_caches", "v_caches")
    if v_pool.device != k_pool.device or v_pool.num_blocks != k_pool.num_blocks:
        raise ValueError(f"v_caches ({v_pool.num_blocks} blocks on {v_pool.device}) must share the pool "
                         f"of k_caches ({k_pool.num_blocks} blocks on {k_pool.device})")
    return Pool(*(a + b for a, b in zip(k_pool[:3], v_pool[:3])), k_pool.num_blocks, k_pool.device)


def _copy_blocks(k_caches, v_caches, block_mapping, backend) -> None:
    pool = _check_copy_pool(k_caches, v_caches)
    n = check_block_mapping(block_mapping, pool.num_blocks, pool.num_blocks, same_pool=True)
    chosen = resolve_backend(backend, pool.device, COPY_BLOCKS_BACKENDS,
                             default_cuda_backend(COPY_BLOCKS_BACKENDS), "copy_blocks")
    if n:
        run_block_copy(chosen, pool, pool, block_mapping, None)


@torch.library.custom_op("cb_kernels::copy_blocks", mutates_args=("k_caches", "v_caches"))
def _copy_blocks_op(k_caches: List[torch.Tensor], v_caches: List[torch.Tensor], block_mapping: torch.Tensor,
                    backend: Optional[str] = None) -> None:
    _copy_blocks(k_caches, v_caches, block_mapping, backend)


@_copy_blocks_op.register_fake
def _(k_caches, v_caches, block_mapping, backend=None) -> None:
    _check_copy_pool(k_caches, v_caches)
