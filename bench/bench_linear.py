"""Our packed GEMM (ops.PackedLinear) against oneDNN's packed matmul, per model shape and row
count, streamed as a step streams them: every layer's qkv, o, gate_up and down weights once
per pass, so at decode sizes the weights come from memory, not cache.

    python bench/bench_linear.py --shape llama-1b --dtype bfloat16 --rows 1,16,64,512 --threads 2

Each row: ms per pass (all layers' four linears), the weights' GB/s, the ratio ours / oneDNN
(> 1: ours faster), and the weight-read floor at the copy bandwidth measured in the same run
(a 512 MiB tensor copy, read + write bytes). The contenders alternate within each repetition.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
import cb_kernels  # noqa: E402,F401
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import cpu_features  # noqa: E402

# (hidden, q_n + 2 kv_n, intermediate, layers)
SHAPES = {"smollm2-135m": (576, 960, 1536, 30), "llama-1b": (2048, 3072, 8192, 16)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def weights(shape: str, dtype) -> list:
    hidden, qkv, inter, layers = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    # qkv, o (heads x head_dim == hidden in both shapes), gate_up, down: [n, k]
    dims = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return [[(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in dims]
            for _ in range(layers)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--rows", default="1,4,16,32,64,128,512")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from cb_kernels.ops import PackedLinear

    dtype = DTYPES[args.dtype]
    ws = weights(args.shape, dtype)
    nbytes = sum(w.numel() * w.element_size() for layer in ws for w in layer)
    ours = [[PackedLinear(w) for w in layer] for layer in ws]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in ws]
    src = torch.empty(512 * 2**20 // 4).uniform_()
    dst = torch.empty_like(src)

    def copy_gbps():
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9

    def pass_ours(xs):
        for layer in ours:
            for lin, x in zip(layer, xs):
                lin.run_unchecked(x)

    def pass_onednn(xs):
        for layer in onednn:
            for w, x in zip(layer, xs):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    rows_list = [int(r) for r in args.rows.split(",") if r]
    out = {"shape": args.shape, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "weight_bytes": nbytes, "cpu_features": cpu_features(), "load_before": os.getloadavg(),
           "rows": []}
    bw = max(copy_gbps() for _ in range(3))
    print(f"{args.shape} {args.dtype}, {torch.get_num_threads()} threads, {nbytes / 1e6:.0f} MB of "
          f"weights a pass, copy {bw:.1f} GB/s (floor {nbytes / bw / 1e6:.2f} ms), load "
          f"{os.getloadavg()[0]:.1f}")
    for rows in rows_list:
        xs = [torch.randn(rows, w.shape[1]).to(dtype) for w in ws[0]]
        best = {"ours": float("inf"), "onednn": float("inf")}
        for fn in (pass_ours, pass_onednn):
            fn(xs)
        for _ in range(args.repeats):
            for name, fn in (("ours", pass_ours), ("onednn", pass_onednn)):
                t0 = time.perf_counter()
                fn(xs)
                best[name] = min(best[name], time.perf_counter() - t0)
        floor = nbytes / (bw * 1e9)
        row = {"rows": rows, "ours_ms": 1e3 * best["ours"], "onednn_ms": 1e3 * best["onednn"],
               "ours_gbps": nbytes / best["ours"] / 1e9, "x_onednn": best["onednn"] / best["ours"],
               "ours_over_floor": best["ours"] / floor,
               "ours_tflops": 2 * rows * nbytes / (2 if dtype == torch.bfloat16 else 4) /
               best["ours"] / 1e12}
        out["rows"].append(row)
        print(f"  {rows:4d} rows: ours {row['ours_ms']:8.2f} ms ({row['ours_gbps']:5.1f} GB/s, "
              f"{row['ours_tflops']:.3f} TFLOP/s, {row['ours_over_floor']:.2f}x floor), oneDNN "
              f"{row['onednn_ms']:8.2f} ms: ours {row['x_onednn']:.2f}x", flush=True)
    out["copy_gbps"], out["load_after"] = bw, os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
