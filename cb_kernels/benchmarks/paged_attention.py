"""Benchmark of cb_kernels.ops.paged_attention (also `python bench/bench_paged_attention.py`).

For decode (batch x context) and prefill shapes it prints each backend's time, achieved GB/s
(q + K/V + out bytes touched / time), the ratio to this machine's copy bandwidth measured in the
same run (a large tensor copy, read + write bytes, measured between the repetitions of every row
so load on a shared machine hits both alike), and the speedup over (a) the pure-torch reference
and (b) transformers' way: gather every sequence's KV into one contiguous copy, repeat the KV
heads, one SDPA over the packed batch with a dense block-diagonal causal float mask (the mask is
built outside the timed region, as transformers builds it once per batch). With --dtype bf16 (or
fp16) on the CPU, "x fp32" is the speedup of the CPU kernel's row over the same kernel and shape
with fp32 K/V, timed alongside: half the bytes, and (bf16 with AVX512-BF16) vdpbf16ps products.

    cb-kernels bench paged_attention --quick
    cb-kernels bench paged_attention --device cuda --json results.json
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.benchmarks.common import write_json
from cb_kernels.ops.paged_attention import DEFAULT_CUDA_BACKEND, run_backend
from cb_kernels.ops.reference import ref_paged_attention
from cb_kernels.runner.kv_cache import host_zeros

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BASELINE_MAX_BYTES = 300 * 2**20  # beyond this KV size the baselines would need GBs of copies


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """seqs: list of (seq_len, q_len). Blocks are shuffled over the pool, as after many steps.
    Values are drawn on the device itself (a 1 GB pool drawn on the CPU takes seconds). On the CPU
    the pool is allocated as the engine allocates its own (`host_zeros`, 4 KiB pages)."""
    torch.manual_seed(seed)
    counts = [math.ceil(s / block_size) for s, _ in seqs]
    num_blocks = sum(counts)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        k_cache, v_cache = host_zeros(shape, dtype).normal_(), host_zeros(shape, dtype).normal_()
    else:
        k_cache = torch.randn(shape, device=device, dtype=dtype)
        v_cache = torch.randn(shape, device=device, dtype=dtype)
    order = torch.randperm(num_blocks).to(torch.int32)
    block_tables = torch.zeros(len(seqs), max(counts), dtype=torch.int32)
    start = 0
    for i, n in enumerate(counts):
        block_tables[i, :n] = order[start:start + n]
        start += n
    q_lens = torch.tensor([q for _, q in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, device=device, dtype=dtype)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables.to(device), seq_lens.to(device), cu.to(device)


def bytes_touched(seqs, q, k_cache):
    per_token = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return 2 * q.numel() * q.element_size() + 2 * per_token * sum(s for s, _ in seqs)


def hf_way(q, k_cache, v_cache, block_tables, seq_lens, cu, seqs):
    """transformers' paged sdpa path: returns a callable doing gather + one masked SDPA."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    slots, mask_rows = [], []
    k_total = sum(s for s, _ in seqs)
    mask = torch.full((q.shape[0], k_total), float("-inf"), device=q.device, dtype=q.dtype)
    k_start = 0
    for i, (seq_len, q_len) in enumerate(seqs):
        pos = torch.arange(seq_len, device=q.device)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
        causal = pos[None, :] <= torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        rows = slice(int(cu[i]), int(cu[i + 1]))
        mask[rows, k_start:k_start + seq_len] = torch.where(causal, 0.0, float("-inf")).to(q.dtype)
        k_start += seq_len
    slots = torch.cat(slots)
    mask = mask[None, None]

    def run():
        k = k_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots)
        v = v_cache.reshape(-1, num_kv_heads, head_dim).index_select(0, slots)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask)
    return run


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def best_time(fn, device, reps, copy=None):
    """Min seconds of one fn call over reps (and of copy, run before each rep, when given).
    On CUDA a rep is 10 back-to-back calls between two syncs, so launch gaps do not count."""
    inner = 10 if device == "cuda" else 1
    fn()
    sync(device)
    best, best_copy = float("inf"), float("inf")
    for _ in range(reps):
        if copy is not None:
            t = time.perf_counter()
            for _ in range(inner):
                copy()
            sync(device)
            best_copy = min(best_copy, (time.perf_counter() - t) / inner)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t) / inner)
    return best, best_copy


def shapes(args):
    if args.quick:
        decode = [(b, c) for b in (1, 16) for c in (512, 2048)]
        prefill = [("prefill 1x512", [(512, 512)]),
                   ("mixed 16 decodes x1024 + chunk 128 of 1024", [(1024, 1)] * 16 + [(1024, 128)])]
    else:
        decode = [(b, c) for b in (1, 4, 16, 64) for c in (512, 2048, 4096, 8192)]
        prefill = [("prefill 1x1024", [(1024, 1024)]), ("prefill 4x512", [(512, 512)] * 4),
                   ("mixed 16 decodes x1024 + chunk 128 of 1024", [(1024, 1)] * 16 + [(1024, 128)])]
    rows = [(f"decode b{b} ctx{c}", [(c, 1)] * b) for b, c in decode] + prefill
    return [r for r in rows if not args.only or any(o in r[0] for o in args.only)]


def bench_rows(args, threads, results: list, save) -> None:
    """Append one row per shape and backend to `results`, calling save() after each."""
    device, dtype = args.device, DTYPES[args.dtype]
    backends = args.backends or [b for b in ops.available_backends() if b != "torch"
                                 and (device == "cuda") == (b in ("cuda", "triton"))]
    src = torch.empty(args.copy_mib * 2**20 // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    copy_bytes = 2 * src.numel() * 4
    for name, seqs in shapes(args):
        inputs = make_batch(seqs, args.heads, args.kv_heads, args.head_dim, args.block_size,
                            dtype, device)
        moved = bytes_touched(seqs, inputs[0], inputs[1])
        small = 2 * inputs[1].numel() * inputs[1].element_size() <= BASELINE_MAX_BYTES
        base = {}
        if small and not args.no_baselines:
            base["ref"] = best_time(lambda: ref_paged_attention(*inputs), device, 2)[0]
            base["hf"] = best_time(hf_way(*inputs, seqs), device, 3)[0]
        out = torch.empty_like(inputs[0])
        scale = args.head_dim ** -0.5
        t_fp32 = None
        if device == "cpu" and dtype != torch.float32 and "cpu" in backends:
            fp32 = make_batch(seqs, args.heads, args.kv_heads, args.head_dim, args.block_size,
                              torch.float32, device)
            out32 = torch.empty_like(fp32[0])
            # With the copy between repetitions, as the rows it is compared with.
            t_fp32 = best_time(lambda: run_backend("cpu", *fp32, out32, scale, 0, 0.0), device,
                               args.reps, copy)[0]
            del fp32
        for backend in backends:
            t, t_copy = best_time(lambda: run_backend(backend, *inputs, out, scale, 0, 0.0),
                                  device, args.reps, copy)
            gbps, copy_gbps = moved / t / 1e9, copy_bytes / t_copy / 1e9
            row = dict(shape=name, backend=backend, threads=threads, ms=t * 1e3, gbps=gbps,
                       copy_gbps=copy_gbps, of_copy=gbps / copy_gbps,
                       x_ref=base["ref"] / t if "ref" in base else None,
                       x_hf=base["hf"] / t if "hf" in base else None,
                       x_fp32=t_fp32 / t if t_fp32 is not None and backend == "cpu" else None)
            results.append(row)
            save()
            fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
            print(f"{name:44s} {backend:7s} {threads or '':>3} {row['ms']:9.3f} {gbps:7.1f} "
                  f"{copy_gbps:7.1f} {row['of_copy']:6.0%} {fmt(row['x_ref']):>8s} "
                  f"{fmt(row['x_hf']):>8s} {fmt(row['x_fp32']):>8s}", flush=True)


def dispatch_overhead(device):
    """Microseconds per call of a 1-token decode: direct, public wrapper, torch.ops."""
    inputs = make_batch([(16, 1)], 4, 1, 64, 16, torch.float32, device)
    out = torch.empty_like(inputs[0])
    backend = "cpu" if device == "cpu" else DEFAULT_CUDA_BACKEND
    calls = {
        "direct run_backend": lambda: run_backend(backend, *inputs, out, 0.125, 0, 0.0),
        "ops.paged_attention": lambda: ops.paged_attention(*inputs, out=out, backend=backend),
        "torch.ops.cb_kernels": lambda: torch.ops.cb_kernels.paged_attention(
            *inputs, out, 0.125, 0, 0.0, backend),
    }
    res = {}
    for name, fn in calls.items():
        res[name] = best_time(lambda: [fn() for _ in range(200)], device, 5)[0] / 200 * 1e6
        print(f"  {name:22s} {res[name]:8.1f} us/call")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--heads", type=int, default=None, help="q heads (default 16 CPU, 32 CUDA)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=None, help="default 64 CPU, 128 CUDA")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", default="1,2", help="CPU thread counts to run, comma separated")
    p.add_argument("--backends", nargs="*", default=None, help="default: all for the device")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--copy-mib", type=int, default=None, help="copy size (default 128 / 1024)")
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--only", nargs="*", default=None,
                   help='rows whose name contains one of these, e.g. --only "decode b16 ctx2048"')
    p.add_argument("--no-baselines", action="store_true", help="skip reference and gather+SDPA")
    p.add_argument("--json", default=None, help="write the result rows to this path")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)")
    gpu = args.device == "cuda"
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    args.heads = args.heads or (32 if gpu else 16)
    args.head_dim = args.head_dim or (128 if gpu else 64)
    args.copy_mib = args.copy_mib or (1024 if gpu else 128)
    print(f"paged_attention: {args.dtype}, {args.heads} q heads, {args.kv_heads} kv heads, "
          f"head_dim {args.head_dim}, block {args.block_size}, device {args.device}")
    print(f"{'shape':44s} {'backend':7s} {'thr':>3} {'ms':>9s} {'GB/s':>7s} {'copy':>7s} "
          f"{'%copy':>6s} {'x ref':>8s} {'x hf':>8s} {'x fp32':>8s}")
    rows, overhead = [], {}

    def save():     # after every row: a run stopped at a time limit keeps the finished ones
        if args.json:
            write_json(args.json, {"config": vars(args), "rows": rows, "dispatch_us": overhead})

    thread_counts = [int(t) for t in args.threads.split(",")] if not gpu else [None]
    for n in thread_counts:
        if n:
            torch.set_num_threads(n)
        bench_rows(args, n, rows, save)
    print("dispatch overhead, 1-token decode:")
    overhead.update(dispatch_overhead(args.device))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
