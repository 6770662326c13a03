"""Resolve the `None` (auto) fields of EngineConfig from the model and the memory at hand.

Every chosen value is logged once at INFO level (logger "cb_kernels.engine") with the numbers it
came from, so a user can copy it into their config.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from cb_kernels.engine.config import EngineConfig

logger = logging.getLogger("cb_kernels.engine")

GiB = 1 << 30
# Share of free memory the KV pool may take: on CUDA the model is already loaded, so what is free
# is ours minus activations (reserved below); on CPU the host is shared with everything else.
CUDA_KV_FRACTION = 0.85
CPU_KV_FRACTION = 0.4
# Token budget per step. CPU: 512 rows already keep 2..16 cores' GEMMs busy (on the 2-core
# bench model a 512-token step takes ~2.5x a 128-token step for 4x the tokens), and a bigger
# budget only delays decodes behind long prefills. CUDA: 4096 fills an H100 for 1-8B models.
CPU_MAX_BATCH_TOKENS = 512
CUDA_MAX_BATCH_TOKENS = 4096
MAX_NUM_SEQS = 256
BLOCK_SIZE = 16


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know about the model (filled by the adapter)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class ResolvedConfig:
    block_size: int
    num_blocks: int
    max_batch_tokens: int
    max_num_seqs: int
    cpu_offload_gib: float
    preemption: str
    prefix_caching: bool
    overlap: str
    attention_backend: Optional[str]
    dtype: torch.dtype


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_available_bytes() -> Optional[int]:
    """Memory left under this process's cgroup limit (v2, then v1); None when unlimited."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages).
        if limit is not None and usage is not None and limit < (1 << 60):
            return max(limit - usage, 0)
    return None


def host_available_bytes() -> int:
    """Available host memory: psutil's view, tightened by the cgroup limit where there is one."""
    import psutil

    available = psutil.virtual_memory().available
    in_cgroup = cgroup_available_bytes()
    return min(available, in_cgroup) if in_cgroup is not None else available


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * elem


def resolve(config: EngineConfig, shape: ModelShape) -> ResolvedConfig:
    on_cuda = shape.device.type == "cuda"
    chosen = {}
    block_size = config.block_size or BLOCK_SIZE
    if config.block_size is None:
        chosen["block_size"] = f"{block_size}"
    dtype = getattr(torch, config.dtype) if config.dtype else shape.dtype
    if config.dtype is None:
        chosen["dtype"] = f"{dtype} (the model's)"
    max_batch_tokens = config.max_batch_tokens
    if max_batch_tokens is None:
        max_batch_tokens = CUDA_MAX_BATCH_TOKENS if on_cuda else CPU_MAX_BATCH_TOKENS
        if config.max_num_seqs is not None:
            max_batch_tokens = max(max_batch_tokens, config.max_num_seqs)
        chosen["max_batch_tokens"] = f"{max_batch_tokens} ({shape.device.type} default)"
    max_num_seqs = config.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = min(MAX_NUM_SEQS, max_batch_tokens)
        chosen["max_num_seqs"] = f"{max_num_seqs}"
    if max_num_seqs > max_batch_tokens:
        raise ValueError(f"max_num_seqs ({max_num_seqs}) must be <= max_batch_tokens "
                         f"({max_batch_tokens})")
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = kv_bytes_per_block(shape, block_size, dtype)
        if on_cuda:
            free, _ = torch.cuda.mem_get_info(shape.device)
            budget, source = int(free * CUDA_KV_FRACTION), f"{free / GiB:.2f} GiB free on {shape.device}"
        else:
            avail = host_available_bytes()
            budget, source = int(avail * CPU_KV_FRACTION), f"{avail / GiB:.2f} GiB available host memory"
        # More blocks than max_num_seqs full-length requests can use would only waste memory.
        useful = max_num_seqs * -(-shape.max_positions // block_size)
        num_blocks = max(1, min(budget // per_block, useful))
        chosen["num_blocks"] = (f"{num_blocks} ({num_blocks * per_block / GiB:.3f} GiB of KV at "
                                f"{per_block} B/block; from {source}, cap {useful} blocks)")
    overlap = config.overlap
    if overlap == "auto" or (overlap == "on" and not on_cuda):
        if overlap == "on":
            logger.warning("overlap='on' needs CUDA streams; running synchronously on %s",
                           shape.device)
        overlap = "on" if on_cuda else "off"
        chosen["overlap"] = f"{overlap} ({shape.device.type})"
    preemption = "recompute" if config.preemption == "auto" else config.preemption
    if config.preemption == "auto":
        chosen["preemption"] = "recompute (no host swap pool in this build)"
    cpu_offload_gib = config.cpu_offload_gib if config.cpu_offload_gib is not None else 0.0
    if config.cpu_offload_gib is None:
        chosen["cpu_offload_gib"] = "0 (no host swap pool in this build)"
    resolved = ResolvedConfig(block_size=block_size, num_blocks=num_blocks,
                              max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                              cpu_offload_gib=cpu_offload_gib, preemption=preemption,
                              prefix_caching=config.prefix_caching, overlap=overlap,
                              attention_backend=config.attention_backend, dtype=dtype)
    for name, why in chosen.items():
        logger.info("EngineConfig.%s auto -> %s", name, why)
    return resolved


def replace(resolved: ResolvedConfig, **changes) -> ResolvedConfig:
    return dataclasses.replace(resolved, **changes)
