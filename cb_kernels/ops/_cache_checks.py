"""Argument checks of the cache ops (write_kv, copy_blocks, swap_blocks).

Each raises ValueError/TypeError naming the argument. They read only shapes, strides and the
CPU-side block mappings, so they never wait on a device, except `check_slot_values` on CUDA
tensors (one reduction and one host sync; see its docstring).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from cb_kernels.ops._backend import check_tensor


def block_layout(t: torch.Tensor, name: str) -> tuple[int, int]:
    """(bytes of one block, bytes between consecutive blocks) of a cache tensor [num_blocks, ...].

    The kernels copy a block as one run of bytes, so everything inside a block must be packed;
    the block dimension itself may be strided (transformers' per-layer views are).
    """
    shape, strides = t.shape, t.stride()
    if len(shape) < 2:
        raise ValueError(f"{name} must be [num_blocks, ...] with at least 2 dimensions, got shape {tuple(shape)}")
    expected = 1
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] != 1 and strides[i] != expected:
            raise ValueError(f"{name} must be packed inside each block (dims 1.. contiguous); got shape "
                             f"{tuple(shape)} with strides {strides}")
        expected *= shape[i]
    if shape[0] > 1 and strides[0] < expected:
        raise ValueError(f"{name}'s blocks overlap: block stride {strides[0]} < {expected} elements per block")
    es = t.element_size()
    return expected * es, strides[0] * es


class Pool(NamedTuple):
    """A checked list of cache tensors and what the kernels need of them (one pass per tensor:
    a swap of 60 tensors spends ~0.1 ms here, not in repeated stride walks)."""
    tensors: list
    block_bytes: list     # bytes of one block per tensor
    block_strides: list   # bytes between blocks per tensor
    num_blocks: int
    device: torch.device

    def spans(self) -> list[tuple[int, int]]:
        """[first byte, one past the last byte) of each tensor."""
        return [(p, p + (self.num_blocks - 1) * s + b)
                for p, s, b in zip(self.ptrs(), self.block_strides, self.block_bytes)]

    def ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]


def check_pool_list(caches, name: str) -> Pool:
    """A list of cache tensors that share one block count, one device and a packed block layout."""
    if isinstance(caches, torch.Tensor) or not isinstance(caches, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors (one per layer and per K/V), got {type(caches).__name__}")
    if len(caches) == 0:
        raise ValueError(f"{name} must not be empty")
    first = caches[0]
    check_tensor(first, f"{name}[0]")
    num_blocks, device = first.shape[0] if first.dim() else 0, first.device
    block_bytes, block_strides = [], []
    for i, t in enumerate(caches):
        if not isinstance(t, torch.Tensor):
            check_tensor(t, f"{name}[{i}]")
        nbytes, stride = block_layout(t, f"{name}[{i}]")
        if t.shape[0] != num_blocks:
            raise ValueError(f"{name}[{i}] has {t.shape[0]} blocks but {name}[0] has {num_blocks}: "
                             f"the tensors of one pool share its block ids")
        if i and t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {device}")
        block_bytes.append(nbytes)
        block_strides.append(stride)
    return Pool(list(caches), block_bytes, block_strides, num_blocks, device)


def pools_overlap(a: Pool, b: Pool) -> bool:
    """Whether tensor i of `a` and tensor i of `b` share memory for some i (one pool, maybe
    through different views)."""
    return any(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a.spans(), b.spans()))


def check_same_geometry(a: list[torch.Tensor], b: list[torch.Tensor], name_a: str, name_b: str) -> None:
    """Pairwise equal dtype and block shape (block counts may differ)."""
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} tensors but {name_b} has {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.dtype != y.dtype:
            raise TypeError(f"{name_a}[{i}] is {x.dtype} but {name_b}[{i}] is {y.dtype}")
        if x.shape[1:] != y.shape[1:]:
            raise ValueError(f"{name_a}[{i}] has blocks of shape {tuple(x.shape[1:])} but {name_b}[{i}] has "
                             f"{tuple(y.shape[1:])}")


def check_block_mapping(block_mapping, num_src_blocks: int, num_dst_blocks: int, same_pool: bool) -> int:
    """Validate an int64 [n, 2] CPU tensor of (src, dst) block ids; returns n.

    Mappings live on the CPU: the wrappers check them without a device sync and the CUDA paths
    turn them into host-side pointer arrays (cuMemcpyBatchAsync takes host arrays).
    """
    name = "block_mapping"
    check_tensor(block_mapping, name)
    if block_mapping.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {block_mapping.dtype}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"{name} must be [n, 2] of (src, dst) pairs, got shape {tuple(block_mapping.shape)}")
    if block_mapping.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (the kernels read it on the host), got {block_mapping.device}")
    if not block_mapping.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {block_mapping.stride()}")
    n = block_mapping.shape[0]
    if n == 0:
        return 0
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for ids, what, limit in ((src, "source", num_src_blocks), (dst, "destination", num_dst_blocks)):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} has {what} block id {bad}, outside [0, {limit})")
    uniq, counts = torch.unique(dst, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name} writes destination block {int(uniq[counts > 1][0])} more than once")
    if same_pool:
        both = torch.isin(dst, src)
        if bool(both.any()):
            raise ValueError(f"{name} uses block {int(dst[both][0])} as both a source and a destination; "
                             f"the result would depend on copy order")
    return n


def check_write_kv(key, value, k_cache, v_cache, slot_mapping) -> torch.device:
    for name, t, ndim in (("key", key, 3), ("value", value, 3), ("k_cache", k_cache, 4),
                          ("v_cache", v_cache, 4), ("slot_mapping", slot_mapping, 1)):
        check_tensor(t, name, ndim=ndim)
    if value.shape != key.shape:
        raise ValueError(f"value has shape {tuple(value.shape)} but key has {tuple(key.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"k_cache is [num_blocks, block_size, {k_cache.shape[2]}, {k_cache.shape[3]}] but key is "
                         f"[num_tokens, {key.shape[1]}, {key.shape[2]}]: num_kv_heads and head_dim must match")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != key.dtype:
            raise TypeError(f"{name} is {t.dtype} but key is {key.dtype}: write_kv never casts")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride 1), got strides {t.stride()}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    device = key.device
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but key is on {device}")
    return device


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots must be -1 or inside the pool, and no slot may be written twice.

    On CUDA this costs a sort of num_tokens ids and one host sync; it is skipped while a
    CUDA graph is being captured, where a sync is not allowed.
    """
    if slot_mapping.numel() == 0:
        return
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if not slot_mapping.is_cuda and slot_mapping.numel() <= 256:
        # Decode-sized batches: plain Python on the list is ~4x cheaper than a chain of small
        # torch ops (12 us -> 3 us for 64 tokens, measured on the 2-core dev box).
        values = slot_mapping.tolist()
        lo, hi = min(values), max(values)
        kept = [v for v in values if v >= 0]
        twice = len(set(kept)) != len(kept)
    else:
        ordered = torch.sort(slot_mapping).values
        lo, hi = int(ordered[0]), int(ordered[-1])
        twice = ordered.numel() > 1 and bool(((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any())
    if lo < -1 or hi >= num_slots:
        bad = lo if lo < -1 else hi
        raise ValueError(f"slot_mapping has slot {bad}, outside [-1, {num_slots}) "
                         f"(num_blocks * block_size = {num_slots}; -1 skips a token)")
    if twice:
        raise ValueError("slot_mapping writes one slot twice; the result would depend on write order")
