"""The bf16 (or fp32) packed GEMM at decode row counts, one linear shape at a time, against
oneDNN's packed linear and the copy bandwidth of the same run (issue #32's 16-row question).

    python bench/bench_gemm_rows.py --threads 1 --rows 1,4,8,16
    python bench/bench_gemm_rows.py --threads 2 --rows 1,4,8,16 --json out.json

Shapes: the Llama-3.2-1B linears [n, k] (qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048,
down 2048 x 8192), --layers copies of each streamed in turn (as the layers of a step: the weights
come from memory, not cache). Each row: ms per linear (best of --repeats passes, the contenders
alternating), x its read floor (weight bytes over the copy rate: a 256 MiB tensor copy, read +
write bytes), GB/s of weight and TFLOP/s. bench/bench_linear.py times the four together.
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

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-onednn", action="store_true", help="time ours only")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if not rows_list or min(rows_list) < 1 or args.layers < 1 or args.repeats < 1:
        p.error("--rows must list positive ints; --layers and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from cb_kernels.ops import PackedLinear

    dtype = DTYPES[args.dtype]
    src = torch.empty(256 * 2**20 // 4).uniform_()
    dst = torch.empty_like(src)

    def copy_gbps():
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9

    bw = max(copy_gbps() for _ in range(4))
    out = {"dtype": args.dtype, "threads": torch.get_num_threads(), "copy_gbps": bw,
           "cpu_features": cpu_features(), "load_before": os.getloadavg(), "rows": []}
    print(f"{args.dtype}, {torch.get_num_threads()} threads, copy {bw:.1f} GB/s, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(args.layers)]
        ours = [PackedLinear(w) for w in ws]
        onednn = [] if args.no_onednn else \
            [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
        del ws
        nbytes = n * k * ours[0].packed.element_size()
        floor = nbytes / (bw * 1e9)
        for m in rows_list:
            x = torch.randn(m, k, generator=g).to(dtype)
            fns = {"ours": lambda: [lin.run_unchecked(x) for lin in ours]}
            if onednn:
                fns["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(
                    x, w, None, "none", [], "") for w in onednn]
            best = dict.fromkeys(fns, float("inf"))
            for fn in fns.values():
                fn()
            for _ in range(args.repeats):
                for key, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    best[key] = min(best[key], (time.perf_counter() - t0) / args.layers)
            row = {"linear": name, "n": n, "k": k, "rows": m, "floor_ms": 1e3 * floor}
            line = f"{name:8s} {m:3d} rows: floor {1e3 * floor:6.3f} ms"
            for key, t in best.items():
                row[f"{key}_ms"] = 1e3 * t
                line += (f" | {key} {1e3 * t:6.3f} ms {t / floor:4.2f}x {nbytes / t / 1e9:5.1f} GB/s "
                         f"{2 * m * n * k / t / 1e12:.3f} TFLOP/s")
            out["rows"].append(row)
            print(line, flush=True)
    out["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
