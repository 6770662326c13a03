"""Benchmark of cb_kernels.ops.GreedyHead: the greedy token of `hidden @ W.T` on CPU.

Contenders, same inputs, same run, each checked to give the same tokens:
  torch          F.linear(h, W) then argmax (what transformers' generate does)
  onednn         the engine's packed oneDNN fp32 head (runner/packed_linears.py) then ops.greedy_tokens
  greedy_head    int8 VNNI scores with a proven bound, exact rescoring of the few candidates
Shapes: the tiny Llama's head (256 x 32000) and SmolLM2-135M's (576 x 49152), fp32, and the
Llama-3.2-1B shape's tied bf16 head (2048 x 128256, std 0.02 as transformers initialises it; its
oneDNN contender is the bf16 GEMM), with Gaussian hidden rows and with rows carrying a few large
"massive activation" dims (as SmolLM2's do), which the greedy head scores exactly after its first
call. Also reported: candidates and exact rescores per row.

    cb-kernels bench greedy_head [--threads 2] [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.ops import GreedyHead

# (name, hidden, vocab, rows, weight dtype, weight std)
SHAPES = [("tiny-llama", 256, 32000, 32, torch.float32, 0.05),
          ("tiny-llama", 256, 32000, 1, torch.float32, 0.05),
          ("smollm2-135m", 576, 49152, 16, torch.float32, 0.05),
          ("llama-1b", 2048, 128256, 16, torch.bfloat16, 0.02)]


def hidden_rows(rows: int, hidden: int, outliers: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    if outliers:        # a few dims at 8-16x the row's RMS, the same dims in every row
        h[:, 7] *= 16.0
        h[:, hidden // 3] *= -9.0
        h[:, hidden // 2] *= 8.0
    return h


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def run_case(name, hidden, vocab, rows, dtype, std, outliers, repeats):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(vocab, hidden, generator=g) * std).to(dtype)
    h = hidden_rows(rows, hidden, outliers, seed=2).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    head = GreedyHead(w)
    head(h)                                   # finds the outlier dims
    want = F.linear(h, w).argmax(-1)
    fns = {"torch": lambda: F.linear(h, w).argmax(-1),
           "onednn": lambda: ops.greedy_tokens(
               torch.ops.mkldnn._linear_pointwise(h, packed, None, "none", [], "")),
           "greedy_head": lambda: head(h)}
    row = {"model": name, "hidden": hidden, "vocab": vocab, "rows": rows, "outliers": outliers,
           "dtype": str(dtype).replace("torch.", ""), "simd": GreedyHead.fast()}
    for label, fn in fns.items():
        assert torch.equal(fn(), want), f"{label} disagrees with torch on {name}"
        row[f"{label}_ms"] = best_ms(fn, repeats)
    row["rescored_per_row"] = head.num_rescored / rows
    row["candidates_per_row"] = head.num_candidates / rows
    row["fp32_rows"] = head.num_fp32_rows
    row["exact_dims"] = head.num_exact
    row["speedup_vs_onednn"] = row["onednn_ms"] / row["greedy_head_ms"]
    row["speedup_vs_torch"] = row["torch_ms"] / row["greedy_head_ms"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch and kernel threads")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="the one-row tiny-llama shape, 3 repeats (smoke run)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 3)
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    results = []
    print(f"threads {torch.get_num_threads()}, VNNI body: {GreedyHead.fast()}")
    for name, hidden, vocab, rows, dtype, std in (SHAPES[1:2] if args.quick else SHAPES):
        for outliers in (False, True):
            r = run_case(name, hidden, vocab, rows, dtype, std, outliers, args.repeats)
            results.append(r)
            print(f"{name:13s} {r['dtype']:8s} {rows:3d} x {hidden} x {vocab}"
                  f"{' outlier dims' if outliers else '':13s}: "
                  f"torch {r['torch_ms']:6.2f} ms, onednn {r['onednn_ms']:6.2f} ms, greedy_head "
                  f"{r['greedy_head_ms']:6.2f} ms ({r['speedup_vs_onednn']:.1f}x onednn, "
                  f"{r['speedup_vs_torch']:.1f}x torch; {r['candidates_per_row']:.0f} candidates and "
                  f"{r['rescored_per_row']:.0f} rescores a row, {r['fp32_rows']} rows to the GEMM, "
                  f"{r['exact_dims']} exact dims)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
