"""The fused MoE experts (ops.moe_experts) alone against transformers' experts forward
(`grouped_mm_experts_forward`: torch._grouped_mm over the pairs sorted by expert, what the
engine ran before) on the same module, inputs and routing, interleaved in one run.

    python bench/bench_moe.py [--dtype bf16|fp32] [--threads 1,2] [--tokens 16,400]
        [--shapes bench,mid] [--repeats 20] [--json out.json] [--block]

Shapes: "bench" is bench_hybrid.py's Qwen3-Next MoE (hidden 256, 8 experts of 128, top 2);
"mid" a larger one (hidden 1024, 32 experts of 512, top 4: 96 MiB of bf16 experts). Routing:
the top-k of a softmax over random logits (seeded), so experts get uneven shares as in a real
step. Also prints the largest difference from transformers' output (bf16: both round every
step; the sums' order differs).

--block times instead a whole Qwen3-Next MoE block (router, route, experts, a shared expert as
wide as one expert with its sigmoid gate) as one ops.moe_block call against the same kernels
called apart from Python (runner/hybrid_layers.py's path before the op), interleaved, and checks
that both give the same bits (steps below ops.moe_block.torch_scalar_rows rows).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from cb_kernels.ops.moe import PackedExperts  # noqa: E402

SHAPES = {"bench": (256, 128, 8, 2), "mid": (1024, 512, 32, 4)}   # hidden, inter, experts, top_k


def experts_module(hidden, inter, num_experts, dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts
    cfg = Qwen3NextConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts)
    cfg._experts_implementation = "grouped_mm"
    m = Qwen3NextExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * hidden ** -0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * inter ** -0.5)
    return m.to(dtype).eval()


def routing(tokens, num_experts, top_k, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=g) * 2, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(dtype)


def best(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def block_rows(a, dtype) -> list:
    """--block: ops.moe_block against the separate calls, per shape, tokens and threads."""
    from cb_kernels import ops
    from cb_kernels.ops.moe import moe_route_unchecked
    from cb_kernels.ops.moe_block import moe_block_unchecked, torch_scalar_rows

    rows = []
    print(f"ops.moe_block vs the separate calls, {a.dtype}, best of {a.repeats} interleaved")
    print(f"{'shape':>6} {'tokens':>6} {'thr':>3} {'apart us':>9} {'block us':>9} {'speedup':>8} "
          f"{'same bits':>9}")
    for shape in a.shapes.split(","):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        g = torch.Generator().manual_seed(3)
        r = lambda *s: (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(dtype)  # noqa: E731
        gate_up, down = ops.PackedLinear(r(2 * inter, hidden)), ops.PackedLinear(r(hidden, inter))
        gate, router = ops.PackedLinear(r(1, hidden)), ops.PackedLinear(r(num_experts, hidden) * 8)
        module = experts_module(hidden, inter, num_experts, dtype)
        experts = PackedExperts(module.gate_up_proj, module.down_proj)
        for tokens in [int(t) for t in a.tokens.split(",")]:
            if tokens >= torch_scalar_rows(dtype):
                continue                 # the engine keeps such steps apart (the sigmoid's exp)
            x = torch.randn(tokens, hidden, generator=g).to(dtype)

            def apart():
                shared = down.run_unchecked(ops.silu_mul(gate_up.run_unchecked(x)))
                w, ids = moe_route_unchecked(router.run_unchecked(x), top_k, True)
                routed = experts.run_unchecked(x, ids, w)
                shared.mul_(gate.run_unchecked(x).sigmoid())
                return routed.add_(shared)

            def block():
                return moe_block_unchecked(x, gate_up, down, gate, router, top_k, True, experts)
            for threads in [int(t) for t in a.threads.split(",")]:
                torch.set_num_threads(threads)
                same = torch.equal(apart(), block())
                t = {"apart": [], "block": []}
                for _ in range(a.repeats):
                    for k, f in (("apart", apart), ("block", block)):
                        t0 = time.perf_counter()
                        for _ in range(20):
                            f()
                        t[k].append((time.perf_counter() - t0) / 20)
                ratio = statistics.median(b / o for b, o in zip(t["apart"], t["block"]))
                row = dict(shape=shape, tokens=tokens, threads=threads, dtype=a.dtype,
                           apart_us=min(t["apart"]) * 1e6, block_us=min(t["block"]) * 1e6,
                           speedup=ratio, same_bits=same)
                rows.append(row)
                print(f"{shape:>6} {tokens:>6} {threads:>3} {row['apart_us']:>9.1f} "
                      f"{row['block_us']:>9.1f} {ratio:>7.2f}x {str(same):>9}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--tokens", default="16,400")
    p.add_argument("--shapes", default="bench,mid")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--block", action="store_true",
                   help="time ops.moe_block against the separate calls instead")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.block:
        rows = block_rows(a, dtype)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"load": os.getloadavg(), "rows": rows}, f, indent=1)
        return
    rows = []
    print(f"ops.moe_experts ({PackedExperts.isa(dtype)} body) vs transformers' grouped_mm experts, "
          f"{a.dtype}, best of {a.repeats} interleaved")
    print(f"{'shape':>6} {'tokens':>6} {'thr':>3} {'grouped_mm ms':>13} {'op ms':>8} {'speedup':>8} "
          f"{'max |diff|':>10}")
    for shape in a.shapes.split(","):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        module = experts_module(hidden, inter, num_experts, dtype)
        packed = PackedExperts(module.gate_up_proj, module.down_proj)
        for tokens in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
            ids, w = routing(tokens, num_experts, top_k, dtype)
            wf = w.float()
            for threads in [int(t) for t in a.threads.split(",")]:
                torch.set_num_threads(threads)
                with torch.inference_mode():
                    ref = module(x, ids, w)
                    got = packed.run_unchecked(x, ids, wf)
                    diff = (ref.float() - got.float()).abs().max().item()
                    fns = {"grouped_mm": lambda: module(x, ids, w),
                           "op": lambda: packed.run_unchecked(x, ids, wf)}
                    t = {k: [] for k in fns}
                    for _ in range(3):
                        for f in fns.values():
                            f()
                    for _ in range(a.repeats):
                        for k, f in fns.items():
                            t[k] += best(f, 1)
                ratio = statistics.median(b / o for b, o in zip(t["grouped_mm"], t["op"]))
                r = dict(shape=shape, tokens=tokens, threads=threads, dtype=a.dtype,
                         grouped_mm_ms=min(t["grouped_mm"]) * 1e3, op_ms=min(t["op"]) * 1e3,
                         speedup=ratio, max_abs_diff=diff, body=PackedExperts.isa(dtype))
                rows.append(r)
                print(f"{shape:>6} {tokens:>6} {threads:>3} {r['grouped_mm_ms']:>13.3f} "
                      f"{r['op_ms']:>8.3f} {ratio:>7.2f}x {diff:>10.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
