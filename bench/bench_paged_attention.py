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

`python bench/bench_paged_attention.py groups [--threads 1] [--tails 8,32]` times fp32 decode at
a GRPO round's layout (SmolLM2 shape, 64 prompts of 20-59 tokens x 8 samples, each sample's rows
sharing its prompt's full blocks, --tails tokens decoded) against the same K/V with every row's
blocks its own (private copies: nothing to share, the kernel without shared-prefix groups), 8
layers called in turn so K/V comes from DRAM as in a step. Run it on two builds for an A/B.
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


def grouped_layers(tail: int, num_layers: int, shared: bool):
    """Per layer (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) of 64 prompts x 8
    decode rows, block_size 16, SmolLM2's 9 / 3 heads x 64, fp32, random values (a timing
    layout: tests/ops/test_paged_attention_groups.py checks the bits); shared=False gives every
    sample blocks of its own for its prompt's full blocks too."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [int(torch.randint(20, 60, (1,), generator=g)) for _ in range(64)]
    layers = []
    for _ in range(num_layers):
        tables, next_block = [], 0
        for plen in prompts:
            full, total = plen // 16, -(-(plen + tail) // 16)
            prefix = list(range(next_block, next_block + full))
            next_block += full
            for _ in range(8):
                own = 0 if shared else full
                tables.append((prefix if shared else []) +
                              list(range(next_block, next_block + total - full + own)))
                next_block += total - full + own
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        order = torch.randperm(next_block, generator=g).to(torch.int32)  # shuffled over the pool
        bt = order[bt.long()]
        k = torch.randn(next_block, 16, 3, 64, generator=g)
        v = torch.randn(next_block, 16, 3, 64, generator=g)
        seq_lens = torch.tensor([p + tail for p in prompts for _ in range(8)], dtype=torch.int32)
        cu = torch.arange(len(tables) + 1, dtype=torch.int32)
        q = torch.randn(len(tables), 9, 64, generator=g)
        layers.append((q, k, v, bt, seq_lens, cu))
    return layers


def groups(argv) -> int:
    import argparse

    import torch

    from cb_kernels.ops.paged_attention import run_backend

    p = argparse.ArgumentParser(description="fp32 decode at a GRPO round's shared-prefix layout")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tails", default="8,32")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for tail in (int(t) for t in args.tails.split(",")):
        res = {}
        for shared in (True, False):
            layers = grouped_layers(tail, 8, shared)
            outs = [torch.empty_like(x[0]) for x in layers]

            def call():
                for batch, out in zip(layers, outs):
                    run_backend("cpu", *batch, out, 0.125, 0, 0.0)
            ts = []
            for _ in range(args.reps):
                t = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t) / len(layers))
            res[shared] = min(ts)
        print(f"{args.threads} thread(s), tail {tail}, load {os.getloadavg()[0]:.2f}: shared "
              f"{res[True] * 1e3:.3f} ms a layer, private copies {res[False] * 1e3:.3f} ms "
              f"({res[True] / res[False]:.3f}x)", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["groups"]:
        import _entry  # noqa: F401  (puts this checkout's cb_kernels first)
        sys.exit(groups(sys.argv[2:]))
    if sys.argv[1:2] == ["floors"]:
        import _entry  # noqa: F401  (puts this checkout's cb_kernels first)
        sys.exit(floors(sys.argv[2:]))
    run("paged_attention")
