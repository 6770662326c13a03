"""The load generator's burst through the Engine, step by step, against each step's FLOP floor:
where bench/serve_burst.py's seconds go.

    python bench/serve_steps.py --threads 2                      # the table (markdown) to stdout
    python bench/serve_steps.py --threads 2 --json steps.json    # plus every step's row

One Engine (bf16 SmolLM2-135M by default), a 16-request warm burst, then the timed burst:
--requests prompts of --input-len random ids, --output-len tokens each (ignore_eos, greedy), all
added at once, `step()` to the end (serve_burst.run_burst's workload). Per step it logs the
decode rows, the prefill tokens, the wall time of `step()` and of the runner's execute (decoder +
greedy head). After the burst every captured step is replayed through the fused forward's
per-op loop (bench/profile_ops.py: same kernels, a clock around each) to split it into linears,
attention, the greedy head and the rest. Floors, from rates measured in this run: linears and
the head at the GEMM rate (ours, the packed bf16 GEMM, 512 x 2048 x 2048 weight in cache);
attention, the larger of its FLOPs (QK and P.V, causal) at that rate and its K/V bytes over the
copy bandwidth. The classes: steps that prefill (any prompt token) and pure decode steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
import cb_kernels  # noqa: E402,F401  (before torch: the OpenMP spin setting)
import torch  # noqa: E402

from profile_ops import OpClock, loop_step  # noqa: E402
from profile_step import copy_gbps, gemm_peak  # noqa: E402
from serve_burst import burst_prompts  # noqa: E402

LINEARS = ("qkv", "o", "gate_up", "down")


def step_shape(inputs) -> dict:
    """Decode rows, prefill tokens and attention work of one packed step."""
    q_lens = torch.diff(inputs.attn.cu_seqlens_q).tolist()
    seq_lens = inputs.attn.seq_lens.tolist()
    decode = sum(1 for q, s in zip(q_lens, seq_lens) if q == 1 and s > 1)
    # causal (query, key) pairs: each new token sees its prefix and itself
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens))
    return {"tokens": int(inputs.input_ids.shape[0]), "decode_rows": decode,
            "prefill_tokens": int(inputs.input_ids.shape[0]) - decode,
            "sampled": int(inputs.logits_indices.shape[0]), "kv_tokens": sum(seq_lens),
            "pairs": pairs}


def snapshot(inputs):
    """A copy of a step's tensors for the replay (the KV pool's layout shared, not copied)."""
    a = inputs.attn
    attn = dataclasses.replace(a, slot_mapping=a.slot_mapping.clone(),
                               block_tables=a.block_tables.clone(), seq_lens=a.seq_lens.clone(),
                               cu_seqlens_q=a.cu_seqlens_q.clone())
    return dataclasses.replace(inputs, input_ids=inputs.input_ids.clone(),
                               positions=inputs.positions.clone(),
                               logits_indices=inputs.logits_indices.clone(), attn=attn)


def floors_s(fused, head, shape: dict, gemm: float, bw: float) -> dict:
    layers = fused.layers
    n_k = sum(getattr(layer, name).lin.n * getattr(layer, name).lin.k
              for layer in layers for name in LINEARS)
    l0 = layers[0]
    vocab, hidden = head.module.weight.shape
    kv_bytes = len(layers) * shape["kv_tokens"] * l0.num_kv_heads * l0.head_dim * 2 * 2
    attn_flop = len(layers) * 4 * shape["pairs"] * l0.num_heads * l0.head_dim
    return {"linears": 2 * shape["tokens"] * n_k / gemm,
            "attention": max(attn_flop / gemm, kv_bytes / bw),
            "head": 2 * shape["sampled"] * vocab * hidden / gemm}


def run(args) -> dict:
    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.models import load

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=args.dtype)
    dtype = getattr(torch, args.dtype)
    bw = copy_gbps() * 1e9
    gemm = gemm_peak(dtype)["ours"]
    engine = Engine(model, EngineConfig(max_batch_tokens=args.max_batch_tokens),
                    tokenizer=tokenizer)
    runner = engine.runner
    if runner.fused is None:
        raise SystemExit("this model does not run the fused CPU forward here")
    inner = runner.execute
    log = []

    def execute(inputs, greedy=False):
        t0 = time.perf_counter()
        out = inner(inputs, greedy)
        log.append({"execute_s": time.perf_counter() - t0, "inputs": snapshot(inputs)})
        return out
    runner.execute = execute
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for p in burst_prompts(tokenizer, vocab, 16, args.input_len, args.seed + 99):
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    log.clear()
    steps = []
    start = time.perf_counter()
    for p in burst_prompts(tokenizer, vocab, args.requests, args.input_len, args.seed):
        engine.add_request(p, params)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    engine.check_invariants()
    runner.execute = inner
    if len(log) != len(steps):
        raise SystemExit(f"{len(steps)} steps but {len(log)} runner calls: not one per step")
    fused, head = runner.fused, runner.head
    rows = []
    for i, (rec, step_s) in enumerate(zip(log, steps)):
        inputs = rec["inputs"]
        args_ = (inputs.input_ids, inputs.positions, inputs.logits_indices, inputs.attn)
        clock = OpClock()
        t0 = time.perf_counter()
        out_rows = loop_step(fused, *args_, clock=clock)
        loop_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        head.tokens(out_rows)
        head_s = time.perf_counter() - t0
        shape = step_shape(inputs)
        sec = dict(clock.seconds)
        rows.append({"step": i, **shape, "step_s": step_s, "execute_s": rec["execute_s"],
                     "loop_s": loop_s, "head_s": head_s,
                     "linears_s": sum(sec.get(n, 0.0) for n in LINEARS),
                     "attention_s": sec.get("attention", 0.0),
                     "other_ops_s": loop_s - sum(sec.get(n, 0.0) for n in LINEARS)
                     - sec.get("attention", 0.0),
                     "ops_s": sec, "floors_s": floors_s(fused, head, shape, gemm, bw)})
    return {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "max_batch_tokens": engine.resolved.max_batch_tokens, "gemm_tflops": gemm / 1e12,
            "copy_gbps": bw / 1e9, "wall_s": wall, "load_average": list(os.getloadavg()),
            "steps": rows}


def summarize(res: dict) -> list:
    """Markdown lines: per class of step, the wall time split and each part against its floor."""
    out = [f"{res['model']} {res['dtype']}, {res['threads']} threads, max_batch_tokens "
           f"{res['max_batch_tokens']}; burst wall {res['wall_s']:.2f} s in {len(res['steps'])} "
           f"steps; GEMM (ours) {res['gemm_tflops']:.3f} TFLOP/s, copy {res['copy_gbps']:.1f} "
           f"GB/s; load {res['load_average'][0]:.1f}", "",
           "| steps | n | decode rows | prefill tokens | step s | execute s | Python s | "
           "replay: linears s (x floor) | attention s (x floor) | head s (x floor) | other ops s |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    classes = {"prefill": [r for r in res["steps"] if r["prefill_tokens"] > 0],
               "decode": [r for r in res["steps"] if r["prefill_tokens"] == 0]}
    classes["all"] = res["steps"]
    for name, rs in classes.items():
        if not rs:
            continue
        tot = {k: sum(r[k] for r in rs) for k in ("step_s", "execute_s", "linears_s",
                                                    "attention_s", "head_s", "other_ops_s")}
        fl = {k: sum(r["floors_s"][k] for r in rs) for k in ("linears", "attention", "head")}
        out.append(
            f"| {name} | {len(rs)} | {sum(r['decode_rows'] for r in rs)} | "
            f"{sum(r['prefill_tokens'] for r in rs)} | {tot['step_s']:.2f} | "
            f"{tot['execute_s']:.2f} | {tot['step_s'] - tot['execute_s']:.2f} | "
            f"{tot['linears_s']:.2f} ({tot['linears_s'] / fl['linears']:.2f}) | "
            f"{tot['attention_s']:.2f} ({tot['attention_s'] / fl['attention']:.2f}) | "
            f"{tot['head_s']:.2f} ({tot['head_s'] / fl['head']:.2f}) | {tot['other_ops_s']:.2f} |")
    ops = sorted({k for r in res["steps"] for k in r["ops_s"]} - set(LINEARS) - {"attention"})
    out += ["", "other ops, s in steps that prefill / pure decode: " + ", ".join(
        f"{k} {sum(r['ops_s'].get(k, 0.0) for r in classes['prefill']):.3f} / "
        f"{sum(r['ops_s'].get(k, 0.0) for r in classes['decode']):.3f}" for k in ops)]
    out += ["", "| step | decode rows | prefill tokens | step ms | x floor (sum of floors) |",
            "|---:|---:|---:|---:|---:|"]
    for r in res["steps"]:
        fl = sum(r["floors_s"].values())
        out.append(f"| {r['step']} | {r['decode_rows']} | {r['prefill_tokens']} | "
                   f"{1e3 * r['step_s']:.1f} | {r['step_s'] / fl:.2f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for flag in ("requests", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        p.error(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")
    res = run(args)
    print("\n".join(summarize(res)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
