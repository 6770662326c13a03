"""write_kv bandwidth (each new token's K and V scattered into shuffled cache slots), in GB/s of
bytes moved, against two baselines measured in the same run (cb_kernels/benchmarks/common.py says how):

- memcpy: one contiguous device copy of the same number of bytes, the ceiling;
- the torch reference (backend="torch": one indexed store per cache).

    cb-kernels bench write_kv [--device cpu|cuda] [--quick] [--json PATH]
"""
from __future__ import annotations

import statistics

import torch

from cb_kernels import ops
from cb_kernels.benchmarks.common import DTYPES, Timer, measure, parse, parser, report, row, save


def bench(args, num_tokens: int, timer: Timer) -> dict:
    dev, dtype = args.device, DTYPES[args.dtype]
    block_size, H, D = 16, args.num_kv_heads, args.head_dim
    num_blocks = 2 * (num_tokens // block_size + 1)
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(num_blocks, block_size, H, D, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, H, D, generator=g).to(dev, dtype)
    value = torch.randn(num_tokens, H, D, generator=g).to(dev, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(dev)
    nbytes = 2 * key.numel() * key.element_size()
    a, b = torch.zeros(nbytes, dtype=torch.uint8, device=dev), torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    t = measure(timer, {"op": lambda: ops.write_kv(key, value, k_cache, v_cache, slots),
                        "memcpy": lambda: b.copy_(a),
                        "torch_ref": lambda: ops.write_kv(key, value, k_cache, v_cache, slots, backend="torch")},
                args.repeats)
    r = row("write_kv", block_size, block_size * H * D * dtype.itemsize, num_tokens, nbytes, t)
    r["torch_ref_gbps"] = nbytes / min(t["torch_ref"]) / 1e9
    r["vs_torch_ref"] = statistics.median(b / o for b, o in zip(t["torch_ref"], t["op"]))
    return r


def main(argv=None) -> int:
    p = parser(__doc__, block_ops=False)
    p.add_argument("--num-tokens", type=int, nargs="+", default=None, help="tokens per call (default 64 2048, "
                   "2048 with --quick)")
    args = parse(p, argv)
    num_tokens = args.num_tokens or ([2048] if args.quick else [64, 2048])
    timer = Timer(args.device, torch.cuda.Stream() if args.device == "cuda" else None)
    rows = []
    for n in num_tokens:
        rows.append(bench(args, n, timer))
        save(args, rows)
    report(args, rows, ["op", "block_tokens", "pairs", "gbps", "memcpy_gbps", "vs_memcpy", "vs_torch_ref"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
