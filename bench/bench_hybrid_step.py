"""Where one engine step of a hybrid bench model goes, at each thread count: per-step Python
outside the model, the model's torch glue, each kernel / packed linear / MoE call, and the
OpenMP parallel regions a step opens (each a fork/join of the thread team).

    python bench/bench_hybrid_step.py [--threads 1,2] [--dtype bfloat16]
        [--shapes qwen3-next-hd128,mamba2-ds128] [--repeats 3] [--json out.json]
        [--baseline] [--separate] [--separate-attention] [--blocks] [--layers]
        [--logits-head] [--mlp-apart] [--rounds N]

Same models and workload as bench_hybrid.py (16 requests, 16..128-token prompts, 32 new tokens,
greedy, EOS off). One Engine per shape and thread count, a warm-up generate, then `--repeats`
timed generates; each call below is timed by a wrapper (~0.3 us each) and the numbers are the
best run's, split into its decode steps (every row one token) and the rest. Parts:
  step, Python outside the model   Engine.step minus runner.prepare and runner.execute
                                   (scheduling, placeholders, token hand-off, stop checks, output)
  inputs (runner.prepare)          the step's tensors: positions, slots, block tables, state plan
  forward, torch glue              runner.execute minus every call below (embeddings, norms,
                                   residuals, transformers' module code, router softmax/top-k)
  the calls                        the fused Qwen3-Next / Mamba-2 stacks (ops.Qwen3NextStack,
                                   ops.Mamba2Stack: a step's whole backbone in one call),
                                   the fused Mamba-2 blocks (ops.fused_hybrid: norm, in_proj,
                                   conv, scan, gated norm, out_proj, residual in one call),
                                   the fused gated delta-net layers (the same up to the MLP,
                                   with both norms),
                                   the fused stateful middle (conv + scan + gated norm), or
                                   ops.causal_conv1d / gated_delta_rule / selective_scan /
                                   gated_rms_norm apart, packed linears (ops.PackedLinear:
                                   the layers' projections, the router's logits),
                                   ops.moe_experts, ops.moe_block (a
                                   Qwen3-Next MLP whole), paged
                                   attention, the greedy head
--baseline also measures each shape with transformers' decoder forward around the same kernels
(runner/hybrid_layers.py off: the path before it, and the one models it does not fit take), in
the same run, rows "<shape>/<threads>/transformers"; --separate the stateful layers' kernels as
separate calls with the split and gates in torch (hybrid_kernels.FUSED off), rows
"<shape>/<threads>/separate"; --separate-attention Qwen3-Next's attention layers as separate
calls (hybrid_layers.FUSED_ATTENTION off: the path before ops.gated_attention_block), rows
"<shape>/<threads>/separate-attention"; --blocks Mamba-2 with one call per block instead of the
stack (hybrid_stack.STACK off), rows "<shape>/<threads>/blocks"; --layers Qwen3-Next with two
calls per layer (its block, its MLP) instead of the stack (hybrid_stack.QWEN3_NEXT_STACK off),
rows "<shape>/<threads>/layers"; --logits-head that and the LM
head's full logits (greedy_head=False), rows "<shape>/<threads>/blocks+logits"; --mlp-apart the
Qwen3-Next MLPs as separate calls (router, route, experts, shared expert, gate: moe_layers.BLOCK
off, the path before ops.moe_block), rows "<shape>/<threads>/mlp-apart". --rounds N runs the
variants N times, alternating (rows "...#i"), and ends with each variant's best and median decode
step against the first variant's.
OpenMP regions are counted by a libgomp shim (LD_PRELOAD, compiled here from the C below with the
system's cc: GOMP_parallel is what every `#pragma omp parallel` of torch, MKL and cb_kernels._C
calls); the script re-executes itself with it. Without a C compiler the counts are left out.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, _HERE)

_SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static unsigned long long regions;
static double seconds;
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags) {
  static parallel_fn real;
  if (!real) real = (parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  regions++;
  double t0 = now();
  real(fn, data, num_threads, flags);
  seconds += now() - t0;
}
unsigned long long cbk_omp_regions(void) { return regions; }
double cbk_omp_seconds(void) { return seconds; }
"""
_SHIM_ENV = "CBK_OMP_COUNT_SHIM"


def _reexec_with_shim() -> None:
    """Compile the shim and run this script again under LD_PRELOAD (once)."""
    if os.environ.get(_SHIM_ENV):
        return
    out = os.path.join(tempfile.gettempdir(), f"cbk_omp_count_{os.getuid()}.so")
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(_SHIM_C)
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", out, f.name, "-ldl"], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no OpenMP region counts (shim not built: {exc})", flush=True)
        os.environ[_SHIM_ENV] = "none"
        return
    finally:
        os.unlink(f.name)
    env = dict(os.environ, LD_PRELOAD=out, **{_SHIM_ENV: out})
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


class Omp:
    def __init__(self):
        path = os.environ.get(_SHIM_ENV, "none")
        self.lib = None if path == "none" else ctypes.CDLL(path)
        if self.lib is not None:
            self.lib.cbk_omp_regions.restype = ctypes.c_ulonglong

    def regions(self) -> int:
        return self.lib.cbk_omp_regions() if self.lib is not None else 0


class Meter:
    """Seconds and OpenMP regions per named part, accumulated over the current step."""

    def __init__(self, omp: Omp):
        self.omp = omp
        self.step: dict = {}
        self.steps: list = []     # (is_decode, {part: [seconds, regions, calls]})

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **k):
            r0, t0 = self.omp.regions(), time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                cell = self.step.setdefault(part, [0.0, 0, 0])
                cell[0] += time.perf_counter() - t0
                cell[1] += self.omp.regions() - r0
                cell[2] += 1
        setattr(owner, name, timed)


CALLS = ("fused Qwen3-Next stack", "fused Mamba-2 stack", "fused Mamba-2 blocks",
         "fused gated delta-net layers",
         "fused attention layers", "fused stateful middle",
         "causal_conv1d", "gated_delta_rule", "selective_scan", "gated_rms_norm",
         "packed linears", "moe_experts", "moe blocks", "paged attention", "greedy head")


def instrument(meter: Meter) -> None:
    from cb_kernels import ops
    from cb_kernels.engine import step_loop
    from cb_kernels.ops import linear, mamba2_stack, moe, qwen3_next_stack
    from cb_kernels.runner import (attention, hybrid_kernels, hybrid_layers, lm_head,
                                   transformers_runner)

    meter.wrap(ops, "causal_conv1d_unchecked", "causal_conv1d")
    meter.wrap(ops, "gated_delta_rule_unchecked", "gated_delta_rule")
    meter.wrap(ops, "selective_scan", "selective_scan")
    meter.wrap(hybrid_kernels, "gated_rms_norm_unchecked", "gated_rms_norm")
    meter.wrap(hybrid_kernels, "gated_delta_net_unchecked", "fused stateful middle")
    meter.wrap(hybrid_kernels, "mamba2_mixer_unchecked", "fused stateful middle")
    meter.wrap(hybrid_kernels, "mamba2_block_unchecked", "fused Mamba-2 blocks")
    meter.wrap(mamba2_stack.Mamba2Stack, "run_unchecked", "fused Mamba-2 stack")
    meter.wrap(qwen3_next_stack.Qwen3NextStack, "run_unchecked", "fused Qwen3-Next stack")
    meter.wrap(hybrid_kernels, "gated_delta_net_block_unchecked", "fused gated delta-net layers")
    meter.wrap(hybrid_layers, "gated_attention_block_unchecked", "fused attention layers")
    meter.wrap(linear.PackedLinear, "run_unchecked", "packed linears")
    meter.wrap(moe.PackedExperts, "run_unchecked", "moe_experts")
    meter.wrap(hybrid_layers, "moe_block_unchecked", "moe blocks")
    meter.wrap(attention.ops, "paged_attention", "paged attention")
    meter.wrap(lm_head.GreedyTokensHead, "tokens", "greedy head")
    meter.wrap(transformers_runner.TransformersRunner, "prepare", "inputs (runner.prepare)")
    meter.wrap(transformers_runner.TransformersRunner, "execute", "execute")
    original = step_loop.StepLoop.step

    def step(self):
        meter.step = {}
        r0, t0 = meter.omp.regions(), time.perf_counter()
        batch = []
        launch = self.launch

        def launch_seen(b, prev=None):
            batch.append(b)
            return launch(b, prev)
        self.launch = launch_seen
        try:
            return original(self)
        finally:
            del self.launch
            meter.step["step"] = [time.perf_counter() - t0, meter.omp.regions() - r0, 1]
            if batch:
                meter.steps.append((all(n == 1 for n in batch[0].num_new_tokens), meter.step))
    step_loop.StepLoop.step = step


def split(steps: list) -> dict:
    """{kind: {part: (ms per step, OpenMP regions per step)}} for decode steps and the rest."""
    out = {}
    for kind, keep in (("decode", True), ("prefill or mixed", False)):
        chosen = [s for d, s in steps if d == keep]
        if not chosen:
            continue
        total = {}
        for s in chosen:
            for part, (sec, reg, calls) in s.items():
                cell = total.setdefault(part, [0.0, 0, 0])
                cell[0] += sec
                cell[1] += reg
                cell[2] += calls
        n = len(chosen)
        get = lambda p: total.get(p, [0.0, 0, 0])  # noqa: E731
        calls = {p: get(p) for p in CALLS if p in total}
        ex, step, prep = get("execute"), get("step"), get("inputs (runner.prepare)")
        rows = {"step, Python outside the model": [step[0] - ex[0] - prep[0],
                                                   step[1] - ex[1] - prep[1]],
                "inputs (runner.prepare)": prep[:2],
                "forward, torch glue": [ex[0] - sum(c[0] for c in calls.values()),
                                        ex[1] - sum(c[1] for c in calls.values())]}
        rows.update({p: c[:2] for p, c in calls.items()})
        rows["whole step"] = step[:2]
        out[kind] = {"steps": n, "parts": {p: {"ms": 1e3 * v[0] / n, "omp_regions": v[1] / n}
                                           for p, v in rows.items()},
                     "calls_per_step": {p: c[2] / n for p, c in calls.items()}}
    return out


def measure(shape: str, dtype, threads: int, repeats: int, meter: Meter,
            ours: bool = True, fused: bool = True, fused_attention: bool = True,
            block: bool = True, stack: bool = True, qwen3_next_stack: bool = True,
            greedy_head="auto") -> dict:
    import torch
    from bench_hybrid import build, workload
    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.runner import hybrid_kernels, hybrid_layers, hybrid_stack, moe_layers

    torch.set_num_threads(threads)
    hybrid_layers.ENABLED = ours
    hybrid_kernels.FUSED = fused
    hybrid_layers.FUSED_ATTENTION = fused_attention
    hybrid_stack.STACK = stack
    hybrid_stack.QWEN3_NEXT_STACK = qwen3_next_stack
    moe_layers.BLOCK = block
    model = build(shape).to(dtype)
    prompts = workload(16, 16, 128)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    engine = Engine(model, EngineConfig(greedy_head=greedy_head))
    engine.generate(prompts, params)
    best = None
    for _ in range(repeats):
        meter.steps = []
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
            best = (seconds, meter.steps)
    return {"seconds": best[0], "tok_s": 16 * 32 / best[0], **split(best[1])}


def show(shape: str, threads: int, row: dict) -> None:
    print(f"{shape}, {threads} thread(s): {row['tok_s']:.1f} tok/s", flush=True)
    for kind in ("decode", "prefill or mixed"):
        if kind not in row:
            continue
        print(f"  {kind} steps ({row[kind]['steps']}): ms per step / OpenMP regions per step")
        for part, v in row[kind]["parts"].items():
            print(f"    {part:34s} {v['ms']:8.3f} {v['omp_regions']:8.1f}")


def summarize(results: dict) -> None:
    """Each variant's best and median decode step over the rounds, and their ratios to the first
    variant's (on a shared host the median is the steadier)."""
    steps = {}
    for key, row in results.items():
        if "#" in key and "decode" in row:
            steps.setdefault(key.split("#")[0], []).append(
                row["decode"]["parts"]["whole step"]["ms"])
    print("decode step over the rounds, ms (best, median; the first variant's / this one's):")
    for name, ms in steps.items():
        base = steps["/".join(name.split("/")[:2])]
        best, med = min(ms), statistics.median(ms)
        print(f"  {name:44s} {best:8.3f} {med:8.3f} {min(base) / best:6.3f}x "
              f"{statistics.median(base) / med:6.3f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--shapes", default="qwen3-next-hd128,mamba2-ds128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--baseline", action="store_true",
                   help="also run transformers' decoder forward (hybrid_layers off)")
    p.add_argument("--separate", action="store_true",
                   help="also run the stateful layers' conv / scan / norm as separate calls "
                        "(hybrid_kernels.FUSED off: the path before ops.fused_hybrid)")
    p.add_argument("--separate-attention", action="store_true",
                   help="also run Qwen3-Next's attention layers as separate calls "
                        "(hybrid_layers.FUSED_ATTENTION off: the path before "
                        "ops.gated_attention_block)")
    p.add_argument("--blocks", action="store_true",
                   help="also run Mamba-2 with one call per block (hybrid_stack.STACK off: the "
                        "path before ops.Mamba2Stack)")
    p.add_argument("--layers", action="store_true",
                   help="also run Qwen3-Next with two calls per layer (hybrid_stack."
                        "QWEN3_NEXT_STACK off: the path before ops.Qwen3NextStack)")
    p.add_argument("--logits-head", action="store_true",
                   help="also run with the stack off and the greedy head off (EngineConfig("
                        "greedy_head=False): bf16 Mamba-2's path before ops.Mamba2Stack)")
    p.add_argument("--mlp-apart", action="store_true",
                   help="also run the Qwen3-Next MLPs as separate calls (moe_layers.BLOCK off: "
                        "the path before ops.moe_block)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variants this many times, alternating (A/B on a noisy host)")
    args = p.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    if any(t < 1 for t in counts) or args.repeats < 1 or args.rounds < 1:
        p.error("--threads must be positive counts, --repeats and --rounds >= 1")
    _reexec_with_shim()
    import torch

    meter = Meter(Omp())
    instrument(meter)
    results = {"dtype": args.dtype, "omp_counted": meter.omp.lib is not None}
    for shape in args.shapes.split(","):
        for t in counts:
            variants = [("", {})]
            if args.mlp_apart and shape.startswith("qwen3-next"):
                variants.append(("/mlp-apart", {"block": False}))
            if args.separate:
                variants.append(("/separate", {"fused": False}))
            if args.separate_attention and shape.startswith("qwen3-next"):
                variants.append(("/separate-attention", {"fused_attention": False}))
            if args.blocks and shape.startswith("mamba2"):
                variants.append(("/blocks", {"stack": False}))
            if args.layers and shape.startswith("qwen3-next"):
                variants.append(("/layers", {"qwen3_next_stack": False}))
            if args.logits_head:
                variants.append(("/blocks+logits", {"stack": False, "greedy_head": False}))
            if args.baseline:
                variants.append(("/transformers", {"ours": False}))
            for r in range(args.rounds):
                for suffix, switches in variants:
                    key = f"{shape}/{t}{suffix}" + (f"#{r}" if args.rounds > 1 else "")
                    row = results[key] = measure(shape, getattr(torch, args.dtype), t,
                                                 args.repeats, meter, **switches)
                    show(key, t, row)
    if args.rounds > 1:
        summarize(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
