"""The load generator's burst through the Engine alone (no HTTP): what the engine's scheduling
costs or buys under `bench_serve.py --loadgen-rates inf`, without the server in the way.

    python bench/serve_burst.py --max-batch-tokens 512,2048 --threads 2
    python bench/serve_burst.py --max-batch-tokens 2048 --profile /tmp/burst.prof   # cProfile

The workload is vLLM's random dataset's shape: --requests prompts of --input-len random token ids
(seeded; the model's special tokens left out), --output-len tokens each with ignore_eos, greedy,
all added at once, then `step()` until done. Per budget: output tok/s (first add to last token),
TTFT mean / p99 (add -> first token), median TPOT ((last token - first token) / (n - 1)), the
number of steps, and the share of the wall time spent in steps that prefill. Each budget gets its
own Engine on the same model, a warm-up burst of 16 requests first, and --repeats timed bursts
(best by tok/s). The budgets run one after the other in the same process: compare the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))


def burst_prompts(tokenizer, vocab_size: int, count: int, input_len: int, seed: int) -> list:
    import torch

    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    g = torch.Generator().manual_seed(seed)
    prompts = []
    while len(prompts) < count:
        ids = torch.randint(0, vocab_size, (input_len,), generator=g).tolist()
        if not special.intersection(ids):
            prompts.append(ids)
    return prompts


def run_burst(engine, prompts: list, output_len: int) -> dict:
    """Add `prompts` at once, step to the end; the burst's figures."""
    from cb_kernels import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.sequence(r) for r in rids]
    num_steps = prefill_steps = 0
    prefill_s = 0.0
    while engine.has_unfinished():
        pending = [(s, s.num_computed_tokens) for s in seqs if s.num_generated_tokens == 0]
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        num_steps += 1
        if any(s.num_computed_tokens != n for s, n in pending):     # this step prefilled
            prefill_steps += 1
            prefill_s += dt
    end = time.perf_counter()
    ttft = sorted(s.metrics.first_token_time - start for s in seqs)
    tpot = [(s.metrics.token_times[-1] - s.metrics.token_times[0]) / (len(s.metrics.token_times) - 1)
            for s in seqs if len(s.metrics.token_times) > 1]
    tokens = sum(s.num_generated_tokens for s in seqs)
    engine.check_invariants()
    return {"duration_s": round(end - start, 3), "output_tok_s": round(tokens / (end - start), 1),
            "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
            "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
            "tpot_median_ms": round(1000 * statistics.median(tpot), 2), "steps": num_steps,
            "prefill_steps": prefill_steps, "prefill_share": round(prefill_s / (end - start), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--max-batch-tokens", default="512,2048",
                   help="comma-separated budgets; \"auto\" = the engine's default")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="cProfile the last budget's timed bursts here")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for flag in ("requests", "input_len", "output_len", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    budgets = []
    for b in args.max_batch_tokens.split(","):
        b = b.strip()
        if b == "auto":
            budgets.append(None)
        elif b.isdigit() and int(b) >= 1:
            budgets.append(int(b))
        else:
            p.error(f"--max-batch-tokens: {b!r} is not a positive integer nor \"auto\"")
    import torch

    from cb_kernels import Engine, EngineConfig
    from cb_kernels.models import load

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=args.dtype)
    vocab = model.config.vocab_size
    rows = []
    for i, budget in enumerate(budgets):
        engine = Engine(model, EngineConfig(max_batch_tokens=budget), tokenizer=tokenizer)
        run_burst(engine, burst_prompts(tokenizer, vocab, 16, args.input_len, args.seed + 99),
                  args.output_len)
        profiler = None
        if args.profile and i == len(budgets) - 1:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        runs = [run_burst(engine, burst_prompts(tokenizer, vocab, args.requests, args.input_len,
                                                args.seed + r), args.output_len)
                for r in range(args.repeats)]
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        best = max(runs, key=lambda r: r["output_tok_s"])
        row = {"max_batch_tokens": engine.resolved.max_batch_tokens, "best": best, "runs": runs}
        rows.append(row)
        print(f"max_batch_tokens {row['max_batch_tokens']}: {best}", file=sys.stderr, flush=True)
    base = rows[0]["best"]
    for row in rows:
        b = row["best"]
        row["vs_first"] = {k: round(b[k] / base[k], 3) for k in
                           ("output_tok_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_median_ms")}
    report = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "requests": args.requests, "input_len": args.input_len,
              "output_len": args.output_len, "load_average": list(os.getloadavg()), "rows": rows}
    print("| max_batch_tokens | output tok/s | TTFT mean / p99 (ms) | TPOT median (ms) | steps "
          "(prefill) | vs first: tok/s, TTFT mean, p99, TPOT |")
    print("|---|---:|---|---:|---|---|")
    for row in rows:
        b, q = row["best"], row["vs_first"]
        print(f"| {row['max_batch_tokens']} | {b['output_tok_s']} | {b['ttft_mean_ms']:.0f} / "
              f"{b['ttft_p99_ms']:.0f} | {b['tpot_median_ms']} | {b['steps']} "
              f"({b['prefill_steps']}) | {q['output_tok_s']}x, {q['ttft_mean_ms']}x, "
              f"{q['ttft_p99_ms']}x, {q['tpot_median_ms']}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
