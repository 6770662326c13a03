"""swap_blocks bandwidth (offload to a HostPool and restore), in GB/s of bytes moved, against two
baselines measured in the same run (cb_kernels/benchmarks/common.py says how):

- memcpy: one contiguous copy of the same number of bytes between the same kinds of memory
  (host<->host on CPU; device->pinned and pinned->device on CUDA), the ceiling;
- transformers: its offload way, per tensor index_select -> copy -> index_copy_.

On CUDA every copy method is timed too: [batch] cuMemcpyBatchAsync, [kernel] the copy kernel over
mapped pinned memory, [memcpy] one cudaMemcpyAsync per run of blocks.

    cb-kernels bench swap_blocks [--device cpu|cuda] [--quick] [--json PATH]
"""
from __future__ import annotations

import torch

from cb_kernels import _C, ops
from cb_kernels.benchmarks.common import (Timer, block_pool, measure, parse, parser, report, row,
                                         save, transformers_way)
from cb_kernels.ops.swap_blocks import _swap_blocks


def bench(args, block_tokens: int, timer: Timer, stream) -> list[dict]:
    dev = args.device
    pool, pairs, block_bytes, g = block_pool(args, block_tokens)
    host = ops.HostPool(pool, pairs + 1)
    for t in host.caches:  # touch every page now, not inside the first timed call
        t.zero_()
    dev_ids = torch.randperm(pool[0].shape[0], generator=g)[:pairs]
    host_ids = torch.randperm(pairs + 1, generator=g)[:pairs]
    out_map, in_map = torch.stack([dev_ids, host_ids], 1), torch.stack([host_ids, dev_ids], 1)
    nbytes = pairs * len(pool) * block_bytes
    flat_dev = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=host.pinned)
    dev_idx, host_idx = dev_ids.to(dev), host_ids
    methods = ["auto"] + (["batch", "kernel", "memcpy"] if dev == "cuda" else [])
    rows = []
    for method in methods:
        if method == "batch" and _C.cuda_batch_memcpy_error():
            continue
        swap_out = lambda: _swap_blocks(pool, host.caches, out_map, backend=None,  # noqa: E731
                                        cuda_method=method, stream=stream)
        swap_in = lambda: _swap_blocks(host.caches, pool, in_map, backend=None,  # noqa: E731
                                       cuda_method=method, stream=stream)
        name = "" if method == "auto" else f"[{method}]"
        t = measure(timer, {"op": swap_out, "memcpy": lambda: flat_host.copy_(flat_dev, non_blocking=True),
                            "transformers": transformers_way(pool, host.caches, dev_idx, host_idx)}, args.repeats)
        rows.append(row("swap_out" + name, block_tokens, block_bytes, pairs, nbytes, t, {"pinned": host.pinned}))
        t = measure(timer, {"op": swap_in, "memcpy": lambda: flat_dev.copy_(flat_host, non_blocking=True),
                            "transformers": transformers_way(host.caches, pool, host_idx, dev_idx)}, args.repeats)
        rows.append(row("swap_in" + name, block_tokens, block_bytes, pairs, nbytes, t, {"pinned": host.pinned}))
    return rows


def main(argv=None) -> int:
    args = parse(parser(__doc__, block_ops=True), argv)
    stream = torch.cuda.Stream() if args.device == "cuda" else None
    timer = Timer(args.device, stream)
    rows = []
    for bt in args.block_tokens:
        rows += bench(args, bt, timer, stream)
        save(args, rows)
    report(args, rows, ["op", "block_tokens", "block_kib", "pairs", "gbps", "memcpy_gbps", "vs_memcpy",
                        "vs_transformers"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
