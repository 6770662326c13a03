"""The per-step cost of structured output (cb_kernels/engine/structured.py): the grammar masks of
the constrained rows and their token updates, inside real decode steps.

    python bench/bench_structured.py [--model smollm2-135m] [--rows 16 64] [--steps 24]
                                     [--threads 2] [--json out.json]

SmolLM2-135M (its real 49,152-token tokenizer, fp32) decodes `--rows` chat requests at once,
each asked for a person as JSON, under a JSON schema whose strings are long enough that every
row is still inside its value for `--steps` steps. After every prefill is done it times
`--steps` decode steps and, inside them, Grammars.mask (bitmask fill + applying it) and
structured.consume. Baselines measured in the same run, same engine, same rows: the same
requests without a grammar, sampled (temperature 1: the same sampler path without the mask)
and greedy (the greedy head where it applies). Prints the mask's ms per step and the step
ratios.
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

import cb_kernels  # noqa: E402,F401  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "biography", "age", "hobbies"],
          "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 60},
                         "biography": {"type": "string", "minLength": 200, "maxLength": 400},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "maxItems": 4,
                                     "items": {"type": "string", "maxLength": 30}}}}
QUESTION = "Describe a fictional person number {i} as JSON with a long biography."


class Timed:
    """Wraps a callable, summing its wall time."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run_case(engine, tokenizer, rows: int, steps: int, params) -> dict:
    from cb_kernels.engine import sampler as sampler_module
    from cb_kernels.engine import structured

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTION.format(i=i)}],
                                             add_generation_prompt=True, tokenize=False)
               for i in range(rows)]
    ids = [engine.add_request(p, params) for p in prompts]
    while any(engine.sequence(i).num_generated_tokens == 0 for i in ids):
        engine.step()
    mask = Timed(engine.grammars.mask)
    consume = Timed(structured.consume)
    engine.grammars.mask, sampler_module.structured.consume = mask, consume
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - t0) / steps
        live = sum(not engine.sequence(i).is_finished for i in ids)
    finally:
        del engine.grammars.mask
        sampler_module.structured.consume = consume.fn
    for i in ids:
        if engine.sequence(i) is not None and not engine.sequence(i).is_finished:
            engine.cancel(i)
    while engine.has_unfinished():
        engine.step()
    return {"step_ms": 1e3 * step_s, "mask_ms": 1e3 * mask.seconds / steps,
            "consume_ms": 1e3 * consume.seconds / steps, "live_rows_at_end": live}


def run(args) -> dict:
    from cb_kernels import Engine, EngineConfig, SamplingParams, StructuredOutput
    from cb_kernels.models import load

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype="float32")
    engine = Engine(model, EngineConfig(max_num_seqs=max(args.rows), num_blocks=2048),
                    tokenizer=tokenizer)
    new = args.steps + 16
    spec = StructuredOutput(json_schema=SCHEMA)
    t0 = time.perf_counter()
    engine.grammars.compile(spec)
    compile_s = time.perf_counter() - t0
    cases = {"structured sampled": SamplingParams(max_new_tokens=new, temperature=1.0, seed=1,
                                                  structured=spec, ignore_eos=True),
             "plain sampled": SamplingParams(max_new_tokens=new, temperature=1.0, seed=1,
                                             ignore_eos=True),
             "structured greedy": SamplingParams(max_new_tokens=new, structured=spec,
                                                 ignore_eos=True),
             "plain greedy": SamplingParams(max_new_tokens=new, ignore_eos=True)}
    out = {"model": args.model, "threads": args.threads, "steps": args.steps,
           "first_compile_s": compile_s, "rows": {}}
    for rows in args.rows:
        res = {}
        for rnd in range(args.repeats):           # alternating rounds, best step time kept
            for name, params in cases.items():
                r = run_case(engine, tokenizer, rows, args.steps, params)
                if name not in res or r["step_ms"] < res[name]["step_ms"]:
                    res[name] = r
        for kind in ("sampled", "greedy"):
            res[f"structured / plain {kind}"] = \
                res[f"structured {kind}"]["step_ms"] / res[f"plain {kind}"]["step_ms"]
        out["rows"][rows] = res
        print(f"{rows} rows:")
        for name, r in res.items():
            if isinstance(r, float):
                print(f"  {name}: {r:.3f}x")
            else:
                print(f"  {name}: step {r['step_ms']:.1f} ms, mask {r['mask_ms']:.2f} ms, "
                      f"consume {r['consume_ms']:.3f} ms, rows still decoding at the end "
                      f"{r['live_rows_at_end']}")
    engine.check_invariants()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
