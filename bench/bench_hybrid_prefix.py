"""Prefix caching for hybrid models: time to the first token of a request whose 512-token prefix
is cached (KV blocks plus a checkpoint of the stateful layers' state) against a miss, on the
engine, in the same run.

    python bench/bench_hybrid_prefix.py [--shapes qwen3-next-hd128,mamba2-ds128]
        [--dtypes float32,bfloat16] [--prefix 512] [--tail 32] [--repeats 5] [--threads 1]
        [--json out.json]

Shapes (bench_hybrid.py's, random weights): qwen3-next-hd128 (3 gated delta-net layers with
head dims 128 + 1 full attention, MoE) and mamba2-ds128 (4 Mamba-2 layers, d_state 128).
Per repeat, on one engine with prefix caching on (auto config, block size 16) and one with it
off, each request alone (generate of 1 token: its time is the time to the first token):
  miss (cache on)   a new random prefix + tail: nothing cached; its prefill is cut at the last
                    full block of the prompt so that state is checkpointed (one more step)
  second            the same prefix + another tail: hits the KV blocks but no state checkpoint
                    at the prefix's end yet, so it recomputes and checkpoints it there
  hit               the same prefix + a third tail: restores the checkpoint after token 512 and
                    prefills only the tail
  miss (cache off)  prefix + the hit's tail on the engine without prefix caching
  hit, old rule     a fourth tail on the cached engine with BlockManager.min_tail_blocks = 1
                    (the rule before 2026-12-06: the tail's own last full block checkpointed
                    too, so a 32-token tail ran as 16 + 16 tokens in two steps)
Reported: medians over the repeats, hit/miss ratios against both misses, and whether the hit's
first 8 greedy tokens equal those of the engine without the cache (fp32: must; bf16: stated).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid import VOCAB, build  # noqa: E402


def ttft(engine, prompt) -> float:
    from cb_kernels import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    seconds = time.perf_counter() - t0
    assert out.finish_reason == "length", out.error
    return seconds


def tokens(engine, prompt, n=8) -> list:
    from cb_kernels import SamplingParams

    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids


def measure(shape: str, dtype: str, prefix_len: int, tail: int, repeats: int) -> dict:
    from cb_kernels import Engine, EngineConfig

    model = build(shape).to(getattr(torch, dtype))
    on = Engine(model, EngineConfig(prefix_caching=True))
    off = Engine(model, EngineConfig(prefix_caching=False))
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    for engine in (on, off):       # one-time costs (first step, lazy buffers) out of the timings
        ttft(engine, rand(prefix_len + tail))
    times = {"miss": [], "second": [], "hit": [], "miss_off": [], "hit_old_rule": []}
    equal = True
    for _ in range(repeats):
        prefix = rand(prefix_len)
        times["miss"].append(ttft(on, prefix + rand(tail)))
        times["second"].append(ttft(on, prefix + rand(tail)))
        hit_prompt = prefix + rand(tail)
        hits_before = on.stats()["state_checkpoint_hits"]
        times["hit"].append(ttft(on, hit_prompt))
        assert on.stats()["state_checkpoint_hits"] == hits_before + 1, "the hit did not hit"
        times["miss_off"].append(ttft(off, hit_prompt))
        equal &= tokens(on, hit_prompt) == tokens(off, hit_prompt)
        rule = on.block_manager.min_tail_blocks
        on.block_manager.min_tail_blocks = 1
        try:
            times["hit_old_rule"].append(ttft(on, prefix + rand(tail)))
        finally:
            on.block_manager.min_tail_blocks = rule
    med = {k: statistics.median(v) for k, v in times.items()}
    on.check_invariants()
    return {"shape": shape, "dtype": dtype, "prefix": prefix_len, "tail": tail,
            "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
            "hit_vs_miss": round(med["miss"] / med["hit"], 2),
            "hit_vs_miss_off": round(med["miss_off"] / med["hit"], 2),
            "old_rule_hit_vs_miss": round(med["miss"] / med["hit_old_rule"], 2),
            "tokens_equal_cache_off": equal,
            "checkpoints": {k: v for k, v in on.stats().items() if "checkpoint" in k}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-next-hd128,mamba2-ds128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--tail", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()}")
    results = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            r = measure(shape, dtype, args.prefix, args.tail, args.repeats)
            results.append(r)
            ms = r["ms"]
            print(f"{shape:18s} {dtype:9s} first token: miss {ms['miss']:8.2f} ms, second "
                  f"{ms['second']:8.2f} ms, hit {ms['hit']:7.2f} ms, miss without cache "
                  f"{ms['miss_off']:8.2f} ms, hit (old rule) {ms['hit_old_rule']:7.2f} ms | hit "
                  f"{r['hit_vs_miss']:.2f}x faster than a miss ({r['old_rule_hit_vs_miss']:.2f}x "
                  f"old rule), {r['hit_vs_miss_off']:.2f}x than no cache | tokens equal: "
                  f"{r['tokens_equal_cache_off']}", flush=True)
    print(f"load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
