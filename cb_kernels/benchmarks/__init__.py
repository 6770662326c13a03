"""Kernel microbenchmarks, shipped with the package so that a wheel install can run them:
``cb-kernels bench <op>`` or ``python -m cb_kernels.benchmarks.<op>``. One module per op, each
with ``main(argv) -> int``; ``bench/bench_<op>.py`` in the source tree are thin entry points.

The engine-level benchmarks (engine, dropin, offload, overlap) need the source tree's bench/
folder (workloads, probes, vLLM scripts) and stay there.
"""
from __future__ import annotations

import importlib

KERNEL_BENCHES = ("paged_attention", "write_kv", "copy_blocks", "swap_blocks", "greedy_head")


def run(name: str, argv: list[str]) -> int:
    """Run the benchmark of op `name` with command-line arguments `argv`; its exit code."""
    if name not in KERNEL_BENCHES:
        raise ValueError(f"no packaged benchmark {name!r}; packaged: {', '.join(KERNEL_BENCHES)}")
    module = importlib.import_module(f"cb_kernels.benchmarks.{name}")
    return int(module.main(argv) or 0)
