"""Auto sizing: every None in EngineConfig is resolved from memory and logged."""
import dataclasses
import logging

import pytest
import torch

from cb_kernels.engine import sizing
from cb_kernels.engine.config import EngineConfig

SHAPE = sizing.ModelShape(num_layers=4, num_kv_heads=2, head_dim=32, max_positions=2048,
                          dtype=torch.float32, device=torch.device("cpu"))


def test_auto_fields_resolved_and_logged(caplog):
    # Imported here, not at module level: one missing package must not take the other tests of
    # this file with it (the GPU image lists psutil; a machine without it skips this one test).
    psutil = pytest.importorskip("psutil", reason="psutil (a declared dependency) is not installed")
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        r = sizing.resolve(EngineConfig(), SHAPE)
    assert r.block_size == 16 and r.max_batch_tokens == 2048 and r.max_num_seqs == 256
    assert r.dtype == torch.float32 and r.overlap == "off" and r.preemption == "auto"
    per_block = 4 * 2 * 16 * 2 * 32 * 4
    assert 0 < r.cpu_offload_gib * (1 << 30) <= r.num_blocks * per_block
    assert sizing.kv_bytes_per_block(SHAPE, 16, torch.float32) == per_block
    # Capped by what 256 full-length requests can use, and by 40% of the available memory.
    assert 1 <= r.num_blocks <= 256 * 2048 // 16
    assert r.num_blocks * per_block <= 0.4 * psutil.virtual_memory().available + per_block
    logged = caplog.text
    for field in ("block_size", "num_blocks", "max_batch_tokens", "max_num_seqs", "dtype",
                  "overlap", "preemption", "cpu_offload_gib"):
        assert f"EngineConfig.{field} auto -> " in logged, field
    assert "GiB available host memory" in logged


def test_num_blocks_follows_available_memory(monkeypatch):
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 10 * (1 << 20))
    r = sizing.resolve(EngineConfig(), SHAPE)
    assert r.num_blocks == int(10 * (1 << 20) * sizing.CPU_KV_FRACTION) // (4 * 2 * 16 * 2 * 32 * 4)


def test_explicit_values_are_kept_and_checked_together():
    r = sizing.resolve(EngineConfig(block_size=8, num_blocks=7, max_num_seqs=3000,
                                    dtype="bfloat16"), dataclasses.replace(SHAPE, dtype=torch.bfloat16))
    assert (r.block_size, r.num_blocks, r.max_num_seqs, r.dtype) == (8, 7, 3000, torch.bfloat16)
    assert r.max_batch_tokens == 3000          # raised to fit one decode token per request


def test_host_memory_respects_cgroup(monkeypatch):
    from cb_kernels.engine.memory import HostMemory
    monkeypatch.setattr(sizing, "read_host_memory", lambda: HostMemory(1 << 30, 1000, 877))
    assert sizing.host_available_bytes() == 123
    monkeypatch.setattr(sizing, "read_host_memory", lambda: HostMemory(1 << 30))
    assert sizing.host_available_bytes() == 1 << 30
