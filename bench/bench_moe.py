"""The fused MoE experts (ops.moe_experts) alone against transformers' experts forward
(`grouped_mm_experts_forward`: torch._grouped_mm over the pairs sorted by expert, what the
engine ran before) on the same module, inputs and routing, interleaved in one run.

    python bench/bench_moe.py [--dtype bf16|fp32] [--threads 1,2] [--tokens 16,400]
        [--shapes bench,mid] [--repeats 20] [--json out.json]

Shapes: "bench" is bench_hybrid.py's Qwen3-Next MoE (hidden 256, 8 experts of 128, top 2);
"mid" a larger one (hidden 1024, 32 experts of 512, top 4: 96 MiB of bf16 experts). Routing:
the top-k of a softmax over random logits (seeded), so experts get uneven shares as in a real
step. Also prints the largest difference from transformers' output (bf16: both round every
step; the sums' order differs).
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--tokens", default="16,400")
    p.add_argument("--shapes", default="bench,mid")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
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
