"""The paged KV pool of one model: per layer, K and V tensors [num_blocks, block_size,
num_kv_heads, head_dim] on the model's device (the layout FlashAttention and vLLM use)."""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch


def host_zeros(shape, dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """A zero CPU tensor whose pages are mapped lazily, as they are first written.

    torch.zeros writes every page (1.1 s for a 1 GiB pool on the bench machine); a private
    anonymous mapping gets the kernel's zero pages as blocks are first written. `huge_pages`
    asks for 2 MiB pages (MADV_HUGEPAGE). Decode attention reads K/V rows scattered over the
    pool and ran 1.5x faster on them (16 x 2048 tokens, one thread: 10.1 -> 6.75 ms), but with
    THP defrag "madvise" the first write to each huge page compacts memory synchronously: 5 ms a
    fault on average, up to 173 ms, measured as write_kv calls in a fresh pool. A short run
    touches fresh pages all the time, so the engine keeps 4 KiB pages.
    Where mmap is missing, numpy's calloc'd memory does the same.
    """
    nbytes = max(1, torch.empty((), dtype=dtype).element_size() * math.prod(shape))
    buf = None
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        try:
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            buf = None
    if buf is None:
        buf = np.zeros(nbytes, dtype=np.uint8)
    # frombuffer's storage keeps `buf` alive. The tensor takes that storage itself rather than
    # being a view of it: a view's `_base` would hold the mapping after Engine.sleep() empties
    # the tensor (set_), and sleep would free nothing (tests/engine/test_rl_gpu.py's CPU twin).
    storage = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes].untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device):
    """(k_caches, v_caches): per layer [num_blocks, block_size, num_kv_heads, head_dim], zeros.
    Zeros, not empty: a stale NaN in a never-written slot must not reach a kernel that multiplies
    it by a zero weight."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros():
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        return host_zeros(shape, dtype)

    return [zeros() for _ in range(num_layers)], [zeros() for _ in range(num_layers)]


def allocate_layer_caches(shapes: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device):
    """Like allocate_kv_cache, one shape per layer: shapes[i] = (num_kv_heads, head_dim) of
    layer i (K and V alike; models whose layers differ, e.g. Gemma 4 or a padded latent V)."""
    def zeros(num_kv_heads, head_dim):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        return host_zeros(shape, dtype)

    return [zeros(*s) for s in shapes], [zeros(*s) for s in shapes]
