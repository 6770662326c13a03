"""copy_blocks bandwidth (copy-on-write of forked prefixes inside one pool), in GB/s of bytes
moved, against two baselines measured in the same run (cb_kernels/benchmarks/common.py says how):

- memcpy: one contiguous device copy of the same number of bytes, the ceiling;
- transformers: per tensor index_select -> index_copy_.

    cb-kernels bench copy_blocks [--device cpu|cuda] [--quick] [--json PATH]
"""
from __future__ import annotations

import torch

from cb_kernels import ops
from cb_kernels.benchmarks.common import (Timer, block_pool, measure, parse, parser, report, row,
                                         save, transformers_way)


def bench(args, block_tokens: int, timer: Timer) -> dict:
    dev = args.device
    pool, pairs, block_bytes, g = block_pool(args, block_tokens)
    num_blocks = pool[0].shape[0]
    src_ids = torch.randperm(num_blocks, generator=g)[:pairs // 2]   # into blocks no pair reads
    taken = set(src_ids.tolist())
    dst_ids = torch.tensor([b for b in range(num_blocks) if b not in taken][:pairs // 2])
    cow = torch.stack([src_ids, dst_ids], 1)
    half = len(pool) // 2
    nbytes = (pairs // 2) * len(pool) * block_bytes
    a = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    b = torch.zeros_like(a)
    t = measure(timer, {"op": lambda: ops.copy_blocks(pool[:half], pool[half:], cow),
                        "memcpy": lambda: b.copy_(a),
                        "transformers": transformers_way(pool, pool, src_ids.to(dev), dst_ids.to(dev))}, args.repeats)
    return row("copy_blocks", block_tokens, block_bytes, pairs // 2, nbytes, t)


def main(argv=None) -> int:
    args = parse(parser(__doc__, block_ops=True), argv)
    timer = Timer(args.device, torch.cuda.Stream() if args.device == "cuda" else None)
    rows = []
    for bt in args.block_tokens:
        rows.append(bench(args, bt, timer))
        save(args, rows)
    report(args, rows, ["op", "block_tokens", "block_kib", "pairs", "gbps", "memcpy_gbps", "vs_memcpy",
                        "vs_transformers"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
