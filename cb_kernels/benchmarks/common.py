"""What the cache-op benchmarks share (write_kv.py, copy_blocks.py, swap_blocks.py beside this): timing, interleaved runs against baselines measured in the same run, the
command-line options every one takes, and the printed table.

Each op runs interleaved with its baselines (op, memcpy, transformers, op, ...); GB/s come from
each one's best run, ratios are medians of per-repeat ratios. The ratios are what to read, not
the absolute GB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

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


def parser(doc: str, block_ops: bool) -> argparse.ArgumentParser:
    """The options every cache-op bench takes, plus the pool options of the block ops."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (smoke run)")
    p.add_argument("--json", metavar="PATH", help="write {meta, rows} here")
    if block_ops:
        p.add_argument("--num-layers", type=int, default=8)
        p.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256])
        p.add_argument("--bytes-per-call", type=int, default=None, help="bytes one call moves (default 64 MiB, "
                       "256 MiB on CUDA, 16 MiB with --quick)")
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parsed options with the defaults that depend on the device and --quick filled in."""
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if hasattr(args, "bytes_per_call"):
        if args.bytes_per_call is None:
            args.bytes_per_call = (16 << 20) if args.quick else ((256 << 20) if args.device == "cuda" else (64 << 20))
        if args.quick:
            args.block_tokens = [16, 256]
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def write_json(path, data) -> None:
    """Write `data` as JSON to `path` through a temporary file and a rename, so that a reader, or a
    benchmark killed at its time limit (bench/gpu_check.sh), finds the last whole file, never half
    of one. The benchmarks call it after every row."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def meta(args) -> dict:
    """The run's settings, written beside the rows."""
    m = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
         "threads": torch.get_num_threads(), "dtype": args.dtype, "num_kv_heads": args.num_kv_heads,
         "head_dim": args.head_dim}
    for k in ("num_layers", "bytes_per_call"):
        if hasattr(args, k):
            m[k] = getattr(args, k)
    return m


def save(args, rows: list[dict]) -> None:
    """With --json: the rows finished so far as {meta, rows} (called after every size)."""
    if args.json:
        write_json(args.json, {"meta": meta(args), "rows": rows})


def report(args, rows: list[dict], cols: list[str]) -> None:
    """Print the run's settings and one line per row; write them as JSON with --json."""
    print(", ".join(f"{k}={v}" for k, v in meta(args).items()))
    print(" ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>15.3g}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>15}" for c in cols))
    save(args, rows)


def block_pool(args, block_tokens: int):
    """A device pool for copy_blocks and swap_blocks: 2 * num_layers tensors [num_blocks,
    block_tokens, num_kv_heads, head_dim] of random values, sized so one call moves about
    --bytes-per-call. Returns (pool, pairs, block_bytes, generator)."""
    dev, dtype = args.device, DTYPES[args.dtype]
    num_tensors = 2 * args.num_layers
    block_bytes = block_tokens * args.num_kv_heads * args.head_dim * dtype.itemsize
    pairs = max(4, args.bytes_per_call // (num_tensors * block_bytes))
    num_blocks = 2 * pairs + 1
    g = torch.Generator().manual_seed(0)
    pool = [torch.randn(num_blocks, block_tokens, args.num_kv_heads, args.head_dim, generator=g).to(dev, dtype)
            for _ in range(num_tensors)]
    return pool, pairs, block_bytes, g
