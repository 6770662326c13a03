"""Entry point of the paged_attention benchmark, which ships with the package
(cb_kernels/benchmarks/paged_attention.py, also `cb-kernels bench paged_attention`); same flags and outputs.

    python bench/bench_paged_attention.py --help

`python bench/bench_paged_attention.py floors [--threads 1,2] [--json F]` instead times the bf16
kernel at the engine's shapes of issue #32 against their floors, K/V cold as in an engine step
(one pool per layer, the layers called in turn): decode at the Llama-3.2-1B shape (16 rows, 32 /
8 heads, contexts 100-200) and at SmolLM2 (128 rows, 9 / 3 heads, contexts 128-192), prefill at
SmolLM2 (16 x 128-token prompts; a burst step of 15 of them and 109 decode rows). Floors: K/V
bytes over the same-run copy bandwidth (a 512 MiB copy, read + write bytes), FLOPs (causal
pairs x 4 x heads x head_dim) over the same-run bf16 GEMM rate (ops.PackedLinear, 512 x 2048 x
2048, weight in cache); a row's floor is the larger.
"""
import json
import os
import sys
import time

from _entry import run

# name: (q heads, kv heads, layers cycled, sequences as (seq_len, q_len) from a seeded draw)
FLOOR_SHAPES = {
    "1b decode 16 x 100-200": (32, 8, 16, lambda r: [(r(100, 201), 1) for _ in range(16)]),
    "smollm2 decode 128 x 128-192": (9, 3, 30, lambda r: [(r(128, 193), 1) for _ in range(128)]),
    "smollm2 prefill 16 x 128": (9, 3, 4, lambda r: [(128, 128)] * 16),
    "smollm2 burst step 15 x 128 + 109 decodes": (
        9, 3, 4, lambda r: [(r(130, 180), 1) for _ in range(109)] + [(128, 128)] * 15),
}


def floors(argv) -> int:
    import argparse

    import torch

    from cb_kernels.benchmarks.paged_attention import make_batch
    from cb_kernels.ops import PackedLinear
    from cb_kernels.ops.paged_attention import run_backend

    p = argparse.ArgumentParser(description="bf16 paged attention at issue #32's shapes vs floors")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    def best(fn, reps):
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    rows = []
    for n in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(n)
        src = torch.empty(512 * 2**20 // 4).uniform_()
        dst = torch.empty_like(src)
        bw = 2 * src.numel() * 4 / best(lambda: dst.copy_(src), 5)
        x = torch.randn(512, 2048).bfloat16()
        lin = PackedLinear((torch.randn(2048, 2048) * 0.02).bfloat16())
        gemm = 2 * 512 * 2048 * 2048 / best(lambda: lin.run_unchecked(x), 5)
        del src, dst
        print(f"{n} thread(s): copy {bw / 1e9:.1f} GB/s, GEMM {gemm / 1e12:.3f} TFLOP/s, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        for name, (heads, kv_heads, num_layers, draw) in FLOOR_SHAPES.items():
            g = torch.Generator().manual_seed(1)
            seqs = draw(lambda a, b: int(torch.randint(a, b, (1,), generator=g)))
            layers = [make_batch(seqs, heads, kv_heads, 64, 16, torch.bfloat16, "cpu", seed=i)
                      for i in range(num_layers)]
            outs = [torch.empty_like(batch[0]) for batch in layers]

            def call():
                for batch, out in zip(layers, outs):
                    run_backend("cpu", *batch, out, 0.125, 0, 0.0)
            t = best(call, args.reps) / num_layers
            kv = sum(s for s, _ in seqs) * kv_heads * 64 * 2 * 2
            pairs = sum(q * (s - q) + q * (q + 1) / 2 for s, q in seqs)
            flop = 4 * pairs * heads * 64
            floor = max(kv / bw, flop / gemm)
            row = dict(shape=name, threads=n, ms=t * 1e3, kv_ms=kv / bw * 1e3,
                       flop_ms=flop / gemm * 1e3, x_floor=t / floor, copy_gbps=bw / 1e9,
                       gemm_tflops=gemm / 1e12, load=os.getloadavg()[0])
            rows.append(row)
            print(f"  {name:42s} {row['ms']:7.3f} ms a layer  K/V {row['kv_ms']:.3f} ms  "
                  f"FLOPs {row['flop_ms']:.3f} ms  {row['x_floor']:.2f}x floor", flush=True)
            del layers, outs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["floors"]:
        import _entry  # noqa: F401  (puts this checkout's cb_kernels first)
        sys.exit(floors(sys.argv[2:]))
    run("paged_attention")
