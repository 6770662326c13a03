"""Cache-op bandwidth: swap_blocks (offload and restore), copy_blocks and write_kv, in GB/s of
bytes moved, against two baselines measured in the same run:

- memcpy: one contiguous copy of the same number of bytes between the same kinds of memory
  (host<->host on CPU; device->pinned, pinned->device or device->device on CUDA), the ceiling;
- transformers: its offload way, per tensor index_select -> copy -> index_copy_.

    python bench/bench_cache.py [--device cpu|cuda] [--quick] [--json PATH]

The three run interleaved (op, memcpy, transformers, op, ...); GB/s come from each one's best
run, ratios are medians of per-repeat ratios. The ratios are what to read, not the absolute GB/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cb_kernels import ops
from cb_kernels.ops import cache_ops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Timer:
    """Seconds per call: wall clock on CPU, CUDA events on `stream` on the GPU."""

    def __init__(self, device: str, stream=None):
        self.cuda = device == "cuda"
        self.stream = stream

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            fn()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def measure(timer: Timer, fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Seconds of each fn, run interleaved: {name: [seconds per repeat]}."""
    for _ in range(warmup):
        for fn in fns.values():
            timer(fn)
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(timer(fn))
    return times


def transformers_way(src_caches, dst_caches, src_ids, dst_ids):
    """transformers' offload: gather on the source, one copy across, scatter on the destination."""
    def run():
        for s, d in zip(src_caches, dst_caches):
            d.index_copy_(0, dst_ids, s.index_select(0, src_ids).to(d.device))
    return run


def row(op, block_tokens, block_bytes, pairs, nbytes, t, extra=None):
    """GB/s from each fn's best run; ratios are medians of per-repeat ratios, each taken between
    runs a few milliseconds apart, so a load spike on the shared machine rarely skews one."""
    def ratio(base):
        return statistics.median(b / o for b, o in zip(t[base], t["op"]))
    r = {"op": op, "block_tokens": block_tokens, "block_kib": block_bytes // 1024, "pairs": pairs,
         "gbps": nbytes / min(t["op"]) / 1e9, "memcpy_gbps": nbytes / min(t["memcpy"]) / 1e9,
         "vs_memcpy": ratio("memcpy")}
    if "transformers" in t:
        r["transformers_gbps"] = nbytes / min(t["transformers"]) / 1e9
        r["vs_transformers"] = ratio("transformers")
    r.update(extra or {})
    return r


def bench_block_ops(args, block_tokens: int, timer: Timer, stream) -> list[dict]:
    dev, dtype = args.device, DTYPES[args.dtype]
    num_tensors = 2 * args.num_layers
    block_bytes = block_tokens * args.num_kv_heads * args.head_dim * dtype.itemsize
    pairs = max(4, args.bytes_per_call // (num_tensors * block_bytes))
    num_blocks = 2 * pairs + 1
    g = torch.Generator().manual_seed(0)
    pool = [torch.randn(num_blocks, block_tokens, args.num_kv_heads, args.head_dim, generator=g).to(dev, dtype)
            for _ in range(num_tensors)]
    host = ops.HostPool(pool, pairs + 1)
    for t in host.caches:  # touch every page now, not inside the first timed call
        t.zero_()
    dev_ids = torch.randperm(num_blocks, generator=g)[:pairs]
    host_ids = torch.randperm(pairs + 1, generator=g)[:pairs]
    out_map, in_map = torch.stack([dev_ids, host_ids], 1), torch.stack([host_ids, dev_ids], 1)
    nbytes = pairs * num_tensors * block_bytes
    flat_dev = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=host.pinned)
    dev_idx, host_idx = dev_ids.to(dev), host_ids
    kw = {"stream": stream}
    methods = ["auto"] + (["batch", "kernel", "memcpy"] if dev == "cuda" else [])
    rows = []
    for method in methods:
        swap_out = lambda: cache_ops._swap_blocks(pool, host.caches, out_map, backend=None,  # noqa: E731
                                                  cuda_method=method, **kw)
        swap_in = lambda: cache_ops._swap_blocks(host.caches, pool, in_map, backend=None,  # noqa: E731
                                                 cuda_method=method, **kw)
        if method == "batch" and ops.cache_ops._C.cuda_batch_memcpy_error():
            continue
        name = "" if method == "auto" else f"[{method}]"
        t = measure(timer, {"op": swap_out, "memcpy": lambda: flat_host.copy_(flat_dev, non_blocking=True),
                            "transformers": transformers_way(pool, host.caches, dev_idx, host_idx)}, args.repeats)
        rows.append(row("swap_out" + name, block_tokens, block_bytes, pairs, nbytes, t, {"pinned": host.pinned}))
        t = measure(timer, {"op": swap_in, "memcpy": lambda: flat_dev.copy_(flat_host, non_blocking=True),
                            "transformers": transformers_way(host.caches, pool, host_idx, dev_idx)},
                    args.repeats)
        rows.append(row("swap_in" + name, block_tokens, block_bytes, pairs, nbytes, t, {"pinned": host.pinned}))
    src_ids = dev_ids[: pairs // 2]  # copy-on-write: half the pairs, into blocks no pair reads
    taken = set(src_ids.tolist())
    dst_ids = torch.tensor([b for b in range(num_blocks) if b not in taken][: pairs // 2])
    cow = torch.stack([src_ids, dst_ids], 1)
    half = num_tensors // 2
    flat_dev2 = torch.zeros_like(flat_dev[: nbytes * (pairs // 2) // pairs])
    t = measure(timer, {"op": lambda: ops.copy_blocks(pool[:half], pool[half:], cow),
                        "memcpy": lambda: flat_dev2.copy_(flat_dev[: flat_dev2.numel()]),
                        "transformers": transformers_way(pool, pool, src_ids.to(dev), dst_ids.to(dev))}, args.repeats)
    rows.append(row("copy_blocks", block_tokens, block_bytes, pairs // 2, flat_dev2.numel(), t))
    return rows


def bench_write_kv(args, num_tokens: int, timer: Timer) -> dict:
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
                        "transformers": lambda: ops.write_kv(key, value, k_cache, v_cache, slots, backend="torch")},
                args.repeats)
    r = row("write_kv", block_size, block_size * H * D * dtype.itemsize, num_tokens, nbytes, t)
    r["vs_torch_ref"] = r.pop("vs_transformers")
    r["torch_ref_gbps"] = r.pop("transformers_gbps")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--bytes-per-call", type=int, default=None, help="bytes one swap call moves (default 64 MiB, "
                   "256 MiB on CUDA, 16 MiB with --quick)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (smoke run)")
    p.add_argument("--json", metavar="PATH", help="write {meta, rows} here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.bytes_per_call is None:
        args.bytes_per_call = (16 << 20) if args.quick else ((256 << 20) if args.device == "cuda" else (64 << 20))
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.quick:
        args.block_tokens = [16, 256]
    if args.threads:
        torch.set_num_threads(args.threads)
    stream = torch.cuda.Stream() if args.device == "cuda" else None
    timer = Timer(args.device, stream)
    rows = []
    for bt in args.block_tokens:
        rows += bench_block_ops(args, bt, timer, stream)
    for n in ([64, 2048] if not args.quick else [2048]):
        rows.append(bench_write_kv(args, n, timer))
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "dtype": args.dtype, "num_layers": args.num_layers,
            "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "bytes_per_call": args.bytes_per_call}
    cols = ["op", "block_tokens", "block_kib", "pairs", "gbps", "memcpy_gbps", "vs_memcpy", "vs_transformers",
            "vs_torch_ref"]
    print(", ".join(f"{k}={v}" for k, v in meta.items()))
    print(" ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>15.3g}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>15}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
