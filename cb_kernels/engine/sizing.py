"""Resolve the `None` (auto) fields of EngineConfig from the model and the memory at hand.

Every chosen value is logged once at INFO level (logger "cb_kernels.engine") with the numbers it
came from, so a user can copy it into their config.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.engine.config import EngineConfig
from cb_kernels.engine.memory import host_pool_bytes, read_host_memory

logger = logging.getLogger("cb_kernels.engine")

GiB = 1 << 30
# Share of free memory the KV pool may take: on CUDA the model is already loaded, so what is free
# is ours minus activations (reserved below); on CPU the host is shared with everything else.
CUDA_KV_FRACTION = 0.85
CPU_KV_FRACTION = 0.4
# Token budget per step (prefill chunks and decodes share it; decodes are scheduled first, so
# a budget never starves them of a step, it only makes the steps that prefill longer).
# CPU: 2048, vLLM-CPU's default for its server. Under a burst the prefills are what everyone
# waits for, and each step also decodes every running request: at 512 a burst of 128 x 128-token
# prompts took 32 steps to prefill, each carrying up to 128 decode rows; at 2048, 8 steps. Measured
# on SmolLM2 bf16, 2-core Zen 4, bench/serve_burst.py: see bench/RESULTS.md "vLLM's load
# generator". At 8 requests/s a step holds one or two prompts either way. CUDA: 4096 fills an
# H100 for 1-8B models.
CPU_MAX_BATCH_TOKENS = 2048
CUDA_MAX_BATCH_TOKENS = 4096
MAX_NUM_SEQS = 256
BLOCK_SIZE = 16


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know about the model (read off the model runner)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype
    device: torch.device
    # Models with stateful layers: bytes of state one running sequence holds (one slot per
    # max_num_seqs comes out of the KV budget); 0 otherwise.
    state_bytes_per_seq: int = 0


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
    # Models with stateful layers and prefix caching on: slots of state saved at block
    # boundaries of cached prefixes (engine/state_slots.py); 0 otherwise.
    num_state_checkpoints: int = 0


def host_available_bytes() -> int:
    """Available host memory (psutil, else /proc/meminfo), tightened by the cgroup limit."""
    return read_host_memory().usable


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return shape.num_layers * 2 * block_size * shape.num_kv_heads * shape.head_dim * elem


def _memory_budget(shape: ModelShape, on_cuda: bool) -> tuple:
    """(bytes the KV pool may take, where that figure came from): a fraction of the free device
    memory (CUDA) or of the available host memory."""
    if on_cuda:
        free, _ = torch.cuda.mem_get_info(shape.device)
        return int(free * CUDA_KV_FRACTION), f"{free / GiB:.2f} GiB free on {shape.device}"
    avail = host_available_bytes()
    return int(avail * CPU_KV_FRACTION), f"{avail / GiB:.2f} GiB available host memory"


def resolve(config: EngineConfig, shape: ModelShape) -> ResolvedConfig:
    on_cuda = shape.device.type == "cuda"
    chosen = {}
    block_size = config.block_size or BLOCK_SIZE
    if config.block_size is None:
        chosen["block_size"] = f"{block_size}"
    dtype = getattr(torch, config.dtype) if config.dtype else shape.dtype
    if config.dtype is None:
        chosen["dtype"] = f"{dtype} (the model's)"
    elif dtype != shape.dtype:
        # The KV cache holds what the layers compute: a cache of another dtype would fail the
        # first step's K/V write (the kernels never cast), so refuse it here.
        name = str(dtype).replace("torch.", "")
        raise ValueError(
            f"EngineConfig.dtype={config.dtype!r} but the model computes in {shape.dtype}: the "
            f"engine runs in the model's dtype. Load the model in {name} "
            f"(cb_kernels.models.load(..., dtype={name!r}), or model.to(torch.{name}), which "
            "converts it in place) or leave dtype=None")
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
    # Prefix caching of a stateful model keeps the state at block boundaries of cached prefixes:
    # one checkpoint per running request, at most a quarter of the KV budget (auto-sized, or
    # with an explicit num_blocks what the auto path would have had left beside that pool).
    checkpoints = max_num_seqs if shape.state_bytes_per_seq and config.prefix_caching else 0
    per_block = kv_bytes_per_block(shape, block_size, dtype)
    if num_blocks is not None and checkpoints:
        budget, _ = _memory_budget(shape, on_cuda)
        budget -= max_num_seqs * shape.state_bytes_per_seq + num_blocks * per_block
        checkpoints = max(1, min(checkpoints, budget // 4 // shape.state_bytes_per_seq))
    if num_blocks is None:
        budget, source = _memory_budget(shape, on_cuda)
        if shape.state_bytes_per_seq:
            state = max_num_seqs * shape.state_bytes_per_seq
            budget = max(per_block, budget - state)
            if checkpoints:
                checkpoints = max(1, min(checkpoints, budget // 4 // shape.state_bytes_per_seq))
                budget = max(per_block, budget - checkpoints * shape.state_bytes_per_seq)
            source += f", less {state / GiB:.3f} GiB of state slots"
        # More blocks than max_num_seqs full-length requests can use would only waste memory.
        useful = max_num_seqs * -(-shape.max_positions // block_size)
        num_blocks = max(1, min(budget // per_block, useful))
        chosen["num_blocks"] = (f"{num_blocks} ({num_blocks * per_block / GiB:.3f} GiB of KV at "
                                f"{per_block} B/block; from {source}, cap {useful} blocks)")
    overlap = config.overlap
    prefix_caching = config.prefix_caching
    if shape.state_bytes_per_seq:
        # A cached KV prefix needs the stateful layers' state at its end: checkpoints of it.
        # A fork (n > 1) copies the state its prefill left, which a step already in flight
        # would have advanced: overlap stays off for these models.
        if prefix_caching:
            logger.info("prefix_caching: on with %d state checkpoints (%.3f GiB; the stateful "
                        "layers' state saved at block boundaries of cached prefixes)",
                        checkpoints, checkpoints * shape.state_bytes_per_seq / GiB)
        if overlap != "off":
            logger.info("overlap: off (the model has stateful layers; forks copy the state of a "
                        "finished prefill, which an overlapped step would already advance)")
            overlap = "off"
    if overlap == "auto":
        overlap = "on" if on_cuda else "off"
        chosen["overlap"] = f"{overlap} ({shape.device.type})"
    elif overlap == "on" and not on_cuda:
        # Kept on: the steps are pipelined the same way (step_loop.py), which is what the CPU
        # tests check; with no asynchronous device nothing runs concurrently, so it buys nothing.
        logger.info("overlap='on' on %s: steps are pipelined, but the device runs them "
                    "synchronously (same tokens, no speed-up)", shape.device)
    preemption = config.preemption
    if preemption == "auto":
        chosen["preemption"] = "auto (swap when the host pool has room and copying is cheaper)"
    cpu_offload_gib = _host_pool_gib(config, num_blocks * kv_bytes_per_block(shape, block_size, dtype))
    if config.cpu_offload_gib is None:
        chosen["cpu_offload_gib"] = (f"{cpu_offload_gib:.3f} GiB (half the usable host memory, "
                                     f"cgroup-aware, capped at the device pool and "
                                     f"{AUTO_HOST_POOL_MAX_GIB} GiB)" if cpu_offload_gib else
                                     "0 (preemption='recompute')")
    resolved = ResolvedConfig(block_size=block_size, num_blocks=num_blocks,
                              max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                              cpu_offload_gib=cpu_offload_gib, preemption=preemption,
                              prefix_caching=prefix_caching, overlap=overlap,
                              attention_backend=config.attention_backend, dtype=dtype,
                              num_state_checkpoints=checkpoints)
    for name, why in chosen.items():
        logger.info("EngineConfig.%s auto -> %s", name, why)
    return resolved


# Auto host pool ceiling: pinning memory costs ~0.3 s per GiB at start-up and takes it from the
# page cache for good; 16 GiB already holds the whole KV pool of a 7B model on an 80 GB GPU.
AUTO_HOST_POOL_MAX_GIB = 16


def _host_pool_gib(config: EngineConfig, device_pool_bytes: int) -> float:
    """Size of the CPU swap pool. None = auto: half the usable host memory (cgroup-aware, no
    psutil needed), capped at the device pool's size (swapped requests never hold more KV than
    the device pool did) and at AUTO_HOST_POOL_MAX_GIB. No pool when preemption is "recompute"."""
    if config.preemption == "recompute":
        if config.cpu_offload_gib:
            logger.info("preemption='recompute': cpu_offload_gib=%s is not used", config.cpu_offload_gib)
        return 0.0
    nbytes = host_pool_bytes(config.cpu_offload_gib)
    if config.cpu_offload_gib is None:
        nbytes = min(nbytes, device_pool_bytes, AUTO_HOST_POOL_MAX_GIB * GiB)
    return nbytes / GiB


def replace(resolved: ResolvedConfig, **changes) -> ResolvedConfig:
    return dataclasses.replace(resolved, **changes)
