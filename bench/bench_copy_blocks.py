"""copy_blocks bandwidth (copy-on-write of forked prefixes inside one pool), in GB/s of bytes
moved, against two baselines measured in the same run (bench/_kernel_bench.py says how):

- memcpy: one contiguous device copy of the same number of bytes, the ceiling;
- transformers: per tensor index_select -> index_copy_.

    python bench/bench_copy_blocks.py [--device cpu|cuda] [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import sys

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # _kernel_bench

import torch  # noqa: E402

from _kernel_bench import Timer, block_pool, measure, parse, parser, report, row, transformers_way  # noqa: E402
from cb_kernels import ops  # noqa: E402


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


def main(argv=None) -> None:
    args = parse(parser(__doc__, block_ops=True), argv)
    timer = Timer(args.device, torch.cuda.Stream() if args.device == "cuda" else None)
    rows = [bench(args, bt, timer) for bt in args.block_tokens]
    report(args, rows, ["op", "block_tokens", "block_kib", "pairs", "gbps", "memcpy_gbps", "vs_memcpy",
                        "vs_transformers"])


if __name__ == "__main__":
    main()
