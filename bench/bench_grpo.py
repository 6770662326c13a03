"""GRPO-shaped rounds (issue #27): each round samples `--prompts` prompts x `--n` completions at
temperature 1, takes one AdamW step on the model, and the next round samples from the stepped
model. Three contenders on the same model, prompts, dtype, threads and sampling settings:

  cb_kernels      an Engine on the trained model itself (no copy: it follows the optimizer's
                  in-place writes); one request per prompt with n completions, logprobs=0 with
                  logprobs_mode="processed" (the per-token logprobs a GRPO loss reads);
                  max_num_seqs = prompts x n (--max-num-seqs), as TRL sizes vLLM's
  trl_default     what TRL 1.16's GRPOTrainer does without vLLM (`_generate_single_turn`, its
                  "regular generation path"): the prompts repeated n times in a row, left-padded
                  with the pad token, one `model.generate(input_ids, attention_mask,
                  generation_config=...)` per generation batch under no_grad, with the
                  GenerationConfig TRL builds (do_sample, temperature, top_p=1, top_k=0,
                  min_p=None, repetition_penalty=1, disable_compile=True); no logprobs come back
  generate_batch  TRL's `use_transformers_continuous_batching=True` call:
                  `model.generate_batch(prompt_ids, generation_config=..., continuous_batching_
                  config=ContinuousBatchingConfig(...), progress_bar=False)` (transformers' own
                  continuous batching), max_memory_percent=0.5 as TRL sets it, with a fixed
                  KV budget (`num_blocks`, the engine's pool in tokens) and max_batch_tokens=512
                  (its 8192 default allocates a dense sdpa mask of gigabytes on the CPU); no
                  logprobs come back

EOS is off on every contender (every completion has exactly --max-new-tokens tokens, so the
rounds do the same work; with EOS on, padded generate would also run every row to the longest
completion: this setting is the kind one for it). The optimizer step is the same for all: a
stand-in loss (the mean log-likelihood of 4 of the round's completions, one forward and
backward) and `AdamW.step()`; it is timed apart from the generation. The first round of each
contender is reported apart (it pays one-time costs: the engine's first packing, transformers'
first allocations); "steady" is the mean of the later rounds.

Weight following (the engine's cost of watching the weights, DESIGN.md "Caches follow the
weights"): `Engine.check_weights()` when nothing changed, against a 16-request decode step of the
same engine and model (bench/bench_weight_watch.py's method), and the same call right after an
optimizer step (it repacks the weight copies: paid once per round).

    python bench/bench_grpo.py --quick --json /tmp/grpo.json      # tiny random Llama, seconds
    python bench/bench_grpo.py --threads 2 --json /tmp/grpo.json  # SmolLM2-135M fp32, 64 x 8 x 64
    python bench/bench_grpo.py --dtype bfloat16 --threads 2       # the same in bf16
    # one contender per command (each under ~10 min), then their ratios from the files:
    python bench/bench_grpo.py --threads 2 --contenders cb_kernels --json /tmp/a.json
    python bench/bench_grpo.py --threads 2 --contenders generate_batch --baseline-rounds 1 \
        --json /tmp/b.json
    python bench/bench_grpo.py --merge /tmp/a.json /tmp/b.json --json /tmp/grpo.json
    # where the engine's step goes (one round after a warm-up call, wall time per part):
    python bench/bench_grpo.py --threads 2 --profile --max-new-tokens 16
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import cb_kernels  # noqa: E402,F401  (before torch: bounds OpenMP's spin-wait for every contender)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import build_tiny_llama, chat_prompts, load_model, versions  # noqa: E402

CONTENDERS = ("cb_kernels", "trl_default", "generate_batch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LR = 1e-6


def quick_prompts(n: int, vocab_size: int, seed: int = 0) -> list:
    """Random prompts of chat-prompt lengths (20..60 tokens) for the tiny model."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 61, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lens]


def optimizer_step(model, optimizer, prompts: list, completions: list) -> float:
    """The trainer's turn, the same for every contender: a stand-in loss (mean log-likelihood of
    the first 4 completions, one padded forward and backward), then AdamW.step(). Seconds."""
    t0 = time.perf_counter()
    rows = [p + c for p, c in zip(prompts[:4], completions[:4])]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, len(p):len(r)] = torch.tensor(r[len(p):])
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def trl_generation_config(model, args, pad_id: int):
    """GRPOTrainer's GenerationConfig for its transformers paths (TRL 1.16, grpo_trainer.py), with
    GRPOConfig's defaults, EOS off (see the module docstring)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True,
                            pad_token_id=pad_id, bos_token_id=model.config.bos_token_id,
                            eos_token_id=None, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                            repetition_penalty=1.0, cache_implementation=None,
                            disable_compile=True)


class EngineRounds:
    def __init__(self, model, args, pool_tokens: int):
        from cb_kernels import Engine, EngineConfig, SamplingParams

        t0 = time.perf_counter()
        # max_num_seqs = the round's rows (prompts x n), as TRL's GRPOTrainer sizes vLLM's
        # max_num_seqs to its generation batch in colocate mode: the round decodes as one batch
        # (the engine's default of 256 ran 512 rows as two waves of 256, twice the steps).
        self.engine = Engine(model, EngineConfig(num_blocks=-(-pool_tokens // 16), block_size=16,
                                                 cpu_offload_gib=0,
                                                 max_num_seqs=args.max_num_seqs))
        self.init_s = time.perf_counter() - t0
        self.params = SamplingParams(n=args.n, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                     logprobs=0, logprobs_mode="processed")
        self.versions = []

    def generate(self, prompts: list) -> tuple:
        outs = self.engine.generate(prompts, self.params)
        self.versions.append(outs[0].weight_version)
        rows, completions = [], []
        for out in outs:
            for o in out.outputs:
                if len(o.logprobs) != len(o.token_ids) or not all(
                        math.isfinite(lp[t]) for t, lp in zip(o.token_ids, o.logprobs)):
                    raise RuntimeError("the engine returned a completion without its logprobs")
                rows.append(out.prompt_token_ids)
                completions.append(o.token_ids)
        return rows, completions


def trl_default_generate(model, gen_config, prompts: list, n: int, batch: int) -> tuple:
    """TRL's regular generation path: each prompt n times in a row, generation batches of
    `batch` rows, each left-padded (the tokenizer's pad id, attention mask) and passed to
    model.generate."""
    rows = [p for p in prompts for _ in range(n)]
    completions = []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), gen_config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        completions += out[:, width:].tolist()
    return rows, completions


def generate_batch_generate(model, gen_config, cb_config, prompts: list, n: int) -> tuple:
    rows = [p for p in prompts for _ in range(n)]
    with torch.no_grad():
        outs = model.generate_batch(rows, generation_config=gen_config,
                                    continuous_batching_config=cb_config, progress_bar=False)
    by_id = list(outs.values())
    failed = [o.error for o in by_id if getattr(o, "error", None)]
    if failed:
        raise RuntimeError(f"generate_batch failed {len(failed)} requests: {failed[0]}")
    return rows, [list(o.generated_tokens) for o in by_id]


def run_rounds(name: str, model, initial: dict, prompts: list, args, rounds: int,
               pool_tokens: int, pad_id: int) -> dict:
    """`rounds` GRPO rounds of one contender from the initial weights; seconds of each part."""
    model.load_state_dict(initial)
    model.train()                   # as GRPOTrainer leaves it (its generate paths do not switch)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    row = {"contender": name, "generate_s": [], "step_s": [], "init_s": 0.0}
    gen_config = trl_generation_config(model, args, pad_id)
    if name == "cb_kernels":
        runner = EngineRounds(model, args, pool_tokens)
        row["init_s"] = runner.init_s
        generate = runner.generate
    elif name == "trl_default":
        def generate(p):
            return trl_default_generate(model, gen_config, p, args.n, args.trl_batch)
    else:
        import inspect

        from transformers import ContinuousBatchingConfig

        # The page size is `page_size` in transformers 5.24, `block_size` in 5.17 (the floor).
        size_arg = ("page_size" if "page_size" in
                    inspect.signature(ContinuousBatchingConfig).parameters else "block_size")
        cb_config = ContinuousBatchingConfig(max_memory_percent=0.5, max_batch_tokens=512,
                                             num_blocks=-(-pool_tokens // 16), **{size_arg: 16})

        def generate(p):
            return generate_batch_generate(model, gen_config, cb_config, p, args.n)
    if rounds == 1 and not args.no_warmup:
        # One timed round has no steady rounds after it: pay the one-time costs untimed first
        # (2 prompts, same settings), so the round reads as a steady one.
        t0 = time.perf_counter()
        generate(prompts[:2])
        row["warmup_s"] = time.perf_counter() - t0
        print(f"{name}: warm-up call {row['warmup_s']:.1f} s; timed round started", flush=True)
    c0 = time.process_time()
    for _ in range(rounds):
        t0 = time.perf_counter()
        rows, completions = generate(prompts)
        row["generate_s"].append(time.perf_counter() - t0)
        if len(completions) != len(prompts) * args.n or \
                any(len(c) != args.max_new_tokens for c in completions):
            raise RuntimeError(f"{name}: expected {len(prompts) * args.n} completions of "
                               f"{args.max_new_tokens} tokens")
        row["step_s"].append(optimizer_step(model, optimizer, rows, completions))
    row["cpu_s"] = time.process_time() - c0
    if name == "cb_kernels":
        row["weight_versions"] = runner.versions
        if not args.no_weight_follow:
            row["weight_follow"] = weight_follow_cost(runner.engine, model, optimizer, prompts,
                                                      args)
        del runner
    gc.collect()
    return summarize(row, len(prompts) * args.n * args.max_new_tokens)


def profile_round(model, prompts: list, args, pool_tokens: int) -> dict:
    """One engine round with wall-clock timers around the parts of a step: the runner (the
    decoder and the LM head), the LM head alone, the sampler and its draws (ops.sample_tokens),
    the logprob recording. Returns {part: (seconds, calls)}; prints ms per step."""
    from collections import defaultdict

    from cb_kernels.engine import engine as engine_mod, sampler, sequence
    from cb_kernels.runner import lm_head, transformers_runner

    spent, calls = defaultdict(float), defaultdict(int)
    timed = [(engine_mod.Engine, "step", "step"),
             (transformers_runner.TransformersRunner, "execute", "runner (decoder + LM head)"),
             (lm_head.LogitsHead, "logits", "LM head"),
             (sampler.Sampler, "__call__", "sampler"),
             (sampler, "sample_tokens_unchecked", "sampler: sample_tokens"),
             (sequence.Sequence, "record_logprob", "sampler: record_logprob")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in timed]

    def timer(fn, key):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
                calls[key] += 1
        return call

    runner = EngineRounds(model, args, pool_tokens)
    runner.generate(prompts[:2])                           # one-time costs, untimed
    for obj, name, key in timed:
        setattr(obj, name, timer(getattr(obj, name), key))
    try:
        t0 = time.perf_counter()
        runner.generate(prompts)
        total = time.perf_counter() - t0
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    steps = calls["step"]
    print(f"one round: {total:.2f} s, {steps} steps, load {os.getloadavg()[0]:.1f}")
    for key in spent:
        print(f"  {key:28s} {1000 * spent[key] / steps:8.1f} ms a step ({calls[key]} calls)")
    return {key: (spent[key], calls[key]) for key in spent} | {"round_s": (total, steps)}


def summarize(row: dict, tokens: int) -> dict:
    gen, step = row["generate_s"], row["step_s"]
    later = gen[1:] or gen
    row["first_generate_s"] = gen[0]
    row["steady_generate_s"] = sum(later) / len(later)
    row["steady_step_s"] = sum(step[1:] or step) / len(step[1:] or step)
    row["steady_round_s"] = row["steady_generate_s"] + row["steady_step_s"]
    row["steady_tok_per_s"] = tokens / row["steady_generate_s"]
    return row


def median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def weight_follow_cost(engine, model, optimizer, prompts: list, args) -> dict:
    """check_weights() with nothing changed vs a 16-request decode step (bench_weight_watch.py's
    method), and check_weights() right after an optimizer step (the repack, once per round)."""
    from cb_kernels import SamplingParams

    params = SamplingParams(max_new_tokens=args.decode_steps + 8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in (prompts * 16)[:16]]
    for _ in range(3):
        engine.step()                       # prefill, then decode
    steps = []
    for _ in range(args.decode_steps):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    checks = []
    for _ in range(200):
        t0 = time.perf_counter()
        engine.check_weights()
        checks.append(time.perf_counter() - t0)
    repacks = []
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()                    # AdamW's decay moves every weight
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        engine.check_weights()
        repacks.append(time.perf_counter() - t0)
    for i in ids:
        engine.cancel(i)
    while engine.has_unfinished():
        engine.step()
    step_ms, check_ms, repack_ms = (median(x) * 1e3 for x in (steps, checks, repacks))
    return {"decode_step_16_ms": step_ms, "check_weights_ms": check_ms,
            "check_pct_of_step": 100 * check_ms / step_ms, "repack_after_step_ms": repack_ms,
            "num_params": len(engine.weights.params)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny random Llama, 8 prompts x 4, 16 tokens, 2 rounds each (seconds)")
    p.add_argument("--model", choices=("smollm2-135m", "tiny-llama"), default="smollm2-135m")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts per round (<= 64)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="engine rounds (the first apart)")
    p.add_argument("--baseline-rounds", type=int, default=2,
                   help="rounds of trl_default and generate_batch (the first apart; with 1, an "
                        "untimed warm-up call on 2 prompts comes first)")
    p.add_argument("--no-warmup", action="store_true",
                   help="with --baseline-rounds 1: no untimed warm-up call first (the one round "
                        "then pays the one-time costs, as the engine's first round does)")
    p.add_argument("--trl-batch", type=int, default=None,
                   help="trl_default's generation batch in rows (default: the whole round, one "
                        "generate call, GRPOTrainer with generation_batch_size = prompts x n)")
    p.add_argument("--skip", default="", help=f"comma-separated contenders of {CONTENDERS}")
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated contenders to run, of {CONTENDERS} (default: all but "
                        "--skip); without cb_kernels no ratio is printed: --merge the files")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no run: join the rows of these files (runs of the same settings, one "
                        "contender each) and print the ratios against cb_kernels's row")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's max_num_seqs (default: prompts x n, the round as one batch, "
                        "as TRL sizes vLLM's; 0: the engine's own default)")
    p.add_argument("--no-weight-follow", action="store_true",
                   help="skip the weight-follow measurement (a run that only adds a baseline)")
    p.add_argument("--profile", action="store_true",
                   help="time the engine's step by part over one round (no contenders)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json, p)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(CONTENDERS) or "cb_kernels" in skip:
        p.error(f"--skip takes trl_default and/or generate_batch, got {args.skip!r}")
    if args.contenders is not None:
        chosen = {s for s in args.contenders.split(",") if s}
        if not chosen or chosen - set(CONTENDERS):
            p.error(f"--contenders takes names of {CONTENDERS}, got {args.contenders!r}")
        skip |= set(CONTENDERS) - chosen
    for name in ("prompts", "n", "max_new_tokens", "rounds", "baseline_rounds", "decode_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.model, args.prompts, args.n, args.max_new_tokens = "tiny-llama", 8, 4, 16
        args.rounds, args.baseline_rounds, args.decode_steps = 2, 2, 3
    args.trl_batch = args.trl_batch or args.prompts * args.n
    if args.max_num_seqs is not None and args.max_num_seqs < 0:
        p.error(f"--max-num-seqs must be >= 0, got {args.max_num_seqs}")
    if args.max_num_seqs is None:
        args.max_num_seqs = args.prompts * args.n
    args.max_num_seqs = args.max_num_seqs or None       # 0: the engine's default
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.model == "tiny-llama":
        model, pad_id = build_tiny_llama().to(dtype), 0
        prompts = quick_prompts(args.prompts, model.config.vocab_size)
    else:
        model, tokenizer, _ = load_model(args.model, dtype)
        if args.prompts > 64:
            p.error(f"--prompts: the chat prompts are 64 questions, asked for {args.prompts}")
        prompts = chat_prompts(tokenizer, args.prompts)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # The KV budget of the engine and of generate_batch: every completion of the round at once.
    pool_tokens = args.prompts * args.n * (max(map(len, prompts)) + args.max_new_tokens + 16)
    if args.profile:
        res = {"meta": {"bench": "grpo_profile", "model": args.model, "prompts": args.prompts,
                        "n": args.n, "max_new_tokens": args.max_new_tokens,
                        "threads": torch.get_num_threads(), "load_before": os.getloadavg()},
               "parts": profile_round(model, prompts, args, pool_tokens)}
        res["meta"]["load_after"] = os.getloadavg()
        write_json(res, args.json)
        return 0
    res = {"meta": {"bench": "grpo", "model": args.model, "dtype": args.dtype,
                    "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                    "prompt_tokens": sum(map(len, prompts)), "trl_batch": args.trl_batch,
                    "max_num_seqs": args.max_num_seqs,
                    "threads": torch.get_num_threads(), "pool_tokens": pool_tokens,
                    "load_before": os.getloadavg(), "versions": versions()},
           "rows": []}
    for name in CONTENDERS:
        if name in skip:
            continue
        rounds = args.rounds if name == "cb_kernels" else args.baseline_rounds
        row = run_rounds(name, model, initial, prompts, args, rounds, pool_tokens, pad_id)
        res["rows"].append(row)
        print(f"{name:15s} first {row['first_generate_s']:7.2f} s  steady generate "
              f"{row['steady_generate_s']:7.2f} s + step {row['steady_step_s']:5.2f} s  "
              f"({row['steady_tok_per_s']:7.1f} tok/s)", flush=True)
        write_json(res, args.json)          # after each contender: a cut-short run keeps rows
    if "cb_kernels" not in skip:
        add_ratios(res)
    res["meta"]["load_after"] = os.getloadavg()
    write_json(res, args.json)
    return 0


def merge(paths: list, out, parser) -> int:
    """The rows of separate runs (one contender each, the same settings) in one result, with
    the ratios against the cb_kernels row; each run's meta (its load, its time) kept."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    keys = ("model", "dtype", "prompts", "n", "max_new_tokens", "threads", "pool_tokens")
    settings = {tuple(r["meta"].get(k) for k in keys) for r in runs}
    if len(settings) != 1:
        parser.error(f"--merge: the runs differ in their settings ({keys}): {sorted(settings)}")
    res = {"meta": {**{k: runs[0]["meta"].get(k) for k in keys}, "merged_from": paths,
                    "runs": [r["meta"] for r in runs]},
           "rows": [row for r in runs for row in r["rows"]]}
    if "cb_kernels" not in {row["contender"] for row in res["rows"]}:
        parser.error("--merge: no file holds a cb_kernels row (the ratios' baseline)")
    add_ratios(res)
    write_json(res, out)
    return 0


def add_ratios(res: dict) -> None:
    rows = {r["contender"]: r for r in res["rows"]}
    ours = rows["cb_kernels"]
    res["ratios"] = {}
    for name in ("trl_default", "generate_batch"):
        if name in rows:
            res["ratios"][name] = {
                "round": rows[name]["steady_round_s"] / ours["steady_round_s"],
                "generate": rows[name]["steady_generate_s"] / ours["steady_generate_s"],
                # a single round came after an untimed warm-up: it has no first round
                "first_generate": rows[name]["first_generate_s"] / ours["first_generate_s"]
                if len(rows[name]["generate_s"]) > 1 else None,
                "cpu": rows[name]["cpu_s"] / len(rows[name]["generate_s"])
                / (ours["cpu_s"] / len(ours["generate_s"]))}
            r = res["ratios"][name]
            first = "" if r["first_generate"] is None else \
                f", first round {r['first_generate']:.2f}x"
            print(f"cb_kernels vs {name}: {r['round']:.2f}x per round (generation "
                  f"{r['generate']:.2f}x{first}, CPU time per round {r['cpu']:.2f}x)")
    wf = ours.get("weight_follow")
    if wf is None:
        return
    print(f"weight following: check_weights {wf['check_weights_ms']:.3f} ms = "
          f"{wf['check_pct_of_step']:.2f}% of a 16-request decode step "
          f"({wf['decode_step_16_ms']:.1f} ms); after an optimizer step (repack) "
          f"{wf['repack_after_step_ms']:.1f} ms; engine weight versions by round "
          f"{ours['weight_versions']}")


def write_json(res: dict, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
