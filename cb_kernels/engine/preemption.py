"""Swap or recompute: the preemption decision for one victim, and which victim frees anything.

Swapping a victim costs two copies of its exclusively owned blocks (out now, in later); recomputing
it costs one prefill of its tokens (prompt + generated so far). "auto" picks the cheaper, estimated
from measured figures when the engine has them and from conservative defaults otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from cb_kernels.engine.config import PREEMPTION_MODES

# Defaults until a measurement replaces them. Pinned PCIe/NVLink host copies run at 20-50 GB/s
# on current GPUs; a 2-core CPU's memcpy measured ~5 GB/s here. Prefill cost per token: a 135M
# model prefilled at ~2k tok/s on this CPU (0.5 ms/token), a 7B model ~10k tok/s on an H100.
DEFAULT_COPY_BYTES_PER_S = {"cuda": 20e9, "cpu": 5e9}
DEFAULT_PREFILL_S_PER_TOKEN = {"cuda": 1e-4, "cpu": 5e-4}


def check_preemption(preemption) -> str:
    if preemption not in PREEMPTION_MODES:
        raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
    return preemption


@dataclass
class PreemptionPolicy:
    """Decides how a victim leaves the device pool.

    `record_prefill(num_tokens, seconds)` and `record_copy(num_bytes, seconds)` feed measured
    rates (exponential moving averages); until then the device defaults above apply.
    """
    mode: str = "auto"
    device_type: str = "cpu"
    copy_bytes_per_s: float | None = None
    prefill_s_per_token: float | None = None
    smoothing: float = 0.2

    def __post_init__(self):
        check_preemption(self.mode)
        kind = "cuda" if self.device_type == "cuda" else "cpu"
        if self.copy_bytes_per_s is None:
            self.copy_bytes_per_s = DEFAULT_COPY_BYTES_PER_S[kind]
        if self.prefill_s_per_token is None:
            self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN[kind]

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            rate = seconds / num_tokens
            self.prefill_s_per_token += self.smoothing * (rate - self.prefill_s_per_token)

    def record_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            rate = num_bytes / seconds
            self.copy_bytes_per_s += self.smoothing * (rate - self.copy_bytes_per_s)

    def swap_seconds(self, num_bytes: int) -> float:
        """Out now and in later: the bytes cross the link twice."""
        return 2 * num_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def choose(self, *, num_tokens: int, swap_blocks: int, freed_blocks: int, block_bytes: int,
               host_free_blocks: int) -> str:
        """"swap" or "recompute" for a victim with `num_tokens` tokens of KV in `swap_blocks`
        blocks, `freed_blocks` of which only it owns (what preempting it gives back).

        A victim that frees nothing (every block shared through the prefix cache) is recomputed:
        host space spent on it would buy no device room, and its KV comes back from the prefix
        cache. Without room in the host pool "swap" also falls back to recompute (never an
        error: progress comes first).
        """
        if self.mode == "recompute" or freed_blocks <= 0 or not 0 < swap_blocks <= host_free_blocks:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        cheaper = self.swap_seconds(swap_blocks * block_bytes) < self.recompute_seconds(num_tokens)
        return "swap" if cheaper else "recompute"


def pick_victim(candidates, freed_blocks):
    """The last candidate (latest admitted first, by the caller's order) that frees at least one
    device block, else the last candidate; None when there is none.

    `freed_blocks(c)` is how many device blocks preempting c returns to the pool (blocks whose
    only owner is c). A victim whose blocks are all shared frees nothing: taking it would loop
    forever, so another victim is chosen while one exists.
    """
    candidates = list(candidates)
    for c in reversed(candidates):
        if freed_blocks(c) > 0:
            return c
    return candidates[-1] if candidates else None
