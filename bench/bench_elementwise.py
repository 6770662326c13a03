"""The fused decoder's elementwise passes, one at a time, against their bytes (issue #32).

    python bench/bench_elementwise.py --threads 1,2 --rows 16,128,2048 [--json out.json]

For SmolLM2-135M's and the Llama-3.2-1B shape's widths, bf16 (or --dtype float32): the RMSNorm
with its residual add, SiLU(gate) * up, and rotary of q and k with the K/V write, each called
through `_C` with its buffers allocated once (so each time is the kernel's plus ~1 us of
pybind11), best of --repeats. Each pass's floor is its bytes read + written over the copy rate
measured in the same run (a 512 MiB tensor copy: DRAM), and "x copy" is time / floor. At decode
sizes everything sits in cache, so a pass can beat that floor; what matters there is ns a row.
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
import cb_kernels  # noqa: E402,F401  (before torch: the OpenMP spin setting)
import torch  # noqa: E402

from cb_kernels import _C  # noqa: E402
from cb_kernels.ops._backend import DTYPE_CODES  # noqa: E402
from profile_step import best, copy_gbps  # noqa: E402  (the same timer and copy rate as the step profile)

# hidden, heads, kv_heads, head_dim, intermediate
SHAPES = {"smollm2-135m": (576, 9, 3, 64, 1536), "llama-1b": (2048, 32, 8, 64, 8192)}


def passes(shape, rows: int, dtype, isa: str):
    """(name, bytes, call) of each pass at `rows` rows."""
    hidden, heads, kv_heads, head_dim, inter = shape
    es = torch.tensor([], dtype=dtype).element_size()
    code = DTYPE_CODES[dtype]
    x = torch.randn(rows, hidden).to(dtype)
    res = torch.randn(rows, hidden).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = torch.empty(rows, hidden, dtype=dtype)

    def norm():
        _C.rms_norm(x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), rows, hidden,
                    hidden, hidden, hidden, 1e-5, isa, code)

    gu = torch.randn(rows, 2 * inter).to(dtype)
    act = torch.empty(rows, inter, dtype=dtype)

    def silu():
        _C.silu_mul(gu.data_ptr(), act.data_ptr(), rows, inter, 2 * inter, inter, isa, code)

    qkv_n = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, qkv_n).to(dtype)
    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    ang = torch.arange(rows)[:, None] * torch.rand(head_dim // 2)[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).contiguous()
    block = 16
    num_blocks = (rows + block - 1) // block + 1
    kc = torch.zeros(num_blocks, block, kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * block)[:rows].to(torch.int64)

    def rope_kv():
        _C.rope_write_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), rows, heads, kv_heads,
                         head_dim, (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)),
                         (v.stride(0), v.stride(1)), kc.stride()[:3], vc.stride()[:3], block,
                         num_blocks * block, isa, code)

    qk = (heads + kv_heads) * head_dim
    return [
        ("rms_norm + residual", es * rows * hidden * 5, norm),       # x, res in; x, out out; (w)
        ("silu_mul", es * rows * inter * 3, silu),                    # gate, up in; act out
        ("rope_write_kv", es * rows * (2 * qk + 2 * head_dim + kv_heads * head_dim * 3), rope_kv),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,128,2048")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--isa", default="auto")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows_list = [int(r) for r in args.rows.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    results = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        _C.set_num_threads(threads)
        bw = copy_gbps() * 1e9
        print(f"{threads} thread(s), {args.dtype}, isa {args.isa}: copy {bw / 1e9:.1f} GB/s, "
              f"load {os.getloadavg()[0]:.2f}")
        for model, shape in SHAPES.items():
            for rows in rows_list:
                for name, nbytes, call in passes(shape, rows, dtype, args.isa):
                    t = best(call, args.repeats)
                    floor = nbytes / bw
                    print(f"  {model:>13} {rows:5d} rows {name:>20}: {t * 1e6:9.1f} us "
                          f"({t * 1e9 / rows:8.1f} ns a row)  x copy {t / floor:5.2f}")
                    results.append({"threads": threads, "model": model, "rows": rows,
                                    "pass": name, "us": t * 1e6, "bytes": nbytes,
                                    "copy_gbps": bw / 1e9, "x_copy": t / floor})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "isa": args.isa, "load": os.getloadavg(),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
