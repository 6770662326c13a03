"""Engine throughput against transformers (and optionally vLLM-CPU) on the same prompts
(greedy, fp32, one process).

    python bench/bench_engine.py [--quick] [--json out.json]
    python bench/bench_engine.py --workload fixed --vllm --repeats 2 --threads 2   # tiny Llama, 32 x 64
    python bench/bench_engine.py --model smollm2-135m --vllm --repeats 2 --threads 2  # 16 chat x 64
    python bench/bench_engine.py --dtype bfloat16 --model-shape llama-1b --workload chat \
        --requests 64 --vllm --threads 2                   # a random Llama-3.2-1B shape, bf16
    python bench/bench_engine.py --device cuda --dtype bfloat16 --model-shape llama-1b \
        --num-requests 128 --json out.json                 # the same shape on a GPU
    python bench/bench_engine.py --overlap [--device cuda]  # step time split, overlap on vs off

Models and workloads: bench/engine_workloads.py. Default: 64 requests with prompt lengths uniform
in 16..512 and their own output lengths 16..256 (--quick: 16 requests, 16..128, 16..64) on a
random tiny Llama (hidden 256, 4 layers, 8/2 heads, MLP 1024, vocab 32000). Contenders:
  cb_kernels        Engine with auto config
  generate_batch    transformers' continuous batching, defaults and tuned (max_batch_tokens=512,
                    num_blocks=64), each request with its own max_new_tokens
  padded generate   one model.generate over the left-padded batch; it must run every row to the
                    longest output, so only the requested tokens count as output
  vllm_cpu          (--vllm) vLLM's CPU build in its own venv and process, after the other rounds
                    (its bound OpenMP threads must not overlap them); start-up is not timed
The engine row times the user's first `generate()` on a fresh `Engine()` ("first call") and the
same call repeated ("steady", its tok/s); on CPU nothing runs before the first call but what
`Engine()` itself does. On CPU the llama-1b shape is loaded from a bf16 safetensors checkpoint
of random weights written once (bench/engine_workloads.py, `llama_1b_checkpoint`), so every run
and vLLM-CPU read the same weights. The JSON records the CPU's features (`versions.cpu_features`).
Output tokens/s counts the requested tokens; ratios are against padded generate (and vLLM-CPU)
measured in the same run, by wall time and by this process's CPU time (on a machine shared with
other jobs the CPU-time ratio is the stable one; with --threads 1 it is the single-core cost
ratio). Also: the scheduler's time per step at 256 running requests (schedule + input packing,
no model) and the time to first token of a fresh process.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Before torch: cb_kernels bounds OpenMP's spin-wait, read once when torch loads libgomp. Every
# in-process contender (transformers' included) runs under the same setting.
import cb_kernels  # noqa: E402,F401
import torch  # noqa: E402
from cb_kernels.benchmarks.common import write_json as write_json_file  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import (LLAMA_1B, MODELS, TINY_LLAMA, WORKLOADS, check_common_args,  # noqa: E402
                              checkpoint_dir, left_padded, load_model, versions, workload)

MODEL_CFG = TINY_LLAMA
MODEL_SHAPES = {"tiny": MODEL_CFG, "llama-1b": dict(MODEL_CFG, **LLAMA_1B)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(seed: int = 0, shape: str = "tiny", device: str = "cpu",
                dtype: torch.dtype = torch.float32):
    """A random Llama of MODEL_SHAPES[shape], its weights created directly on `device` in `dtype`
    (a 1B model built on the CPU in fp32 and then moved would take ~10x longer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL_SHAPES[shape], attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
    finally:
        torch.set_default_dtype(old)
    # No EOS: every contender produces exactly the requested number of tokens.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def warmup_params(prompts, outputs, on_gpu: bool):
    """The untimed warm-up run: (prompts, [SamplingParams]).

    On a GPU every one-time cost the timed run would meet is paid here: each decode batch size
    captures its CUDA graph bucket on first use, and Triton compiles one kernel per specialisation
    (decode or mixed batch, split count from the KV span, num_seqs == 1), ~1 s each. So the
    warm-up runs the timed prompts themselves (same lengths: same prefill shapes and KV spans)
    with request i stopping after i + 1 tokens: the decode batch then shrinks one request per
    step from len(prompts) to 1 and passes through every graph bucket the timed run can reach,
    and its longest output (len(prompts) tokens, capped by the timed run's longest) needs no more
    KV than the timed run. On the CPU nothing is captured or compiled: the same warm-up over the
    first 4 prompts cut to 8 tokens warms the caches (the sizes differ, not the code)."""
    from cb_kernels import SamplingParams

    n = len(prompts) if on_gpu else min(4, len(prompts))
    warm = prompts[:n] if on_gpu else [p[:8] for p in prompts[:n]]
    return warm, [SamplingParams(max_new_tokens=min(i + 1, max(outputs))) for i in range(n)]


def run_engine(model, prompts, outputs, **config):
    """((seconds, cpu seconds) of the steady call, tokens, engine stats with the first call's
    time): Engine(), then generate() twice on the same prompts."""
    from cb_kernels import Engine, EngineConfig, SamplingParams

    # This workload never runs out of device blocks (the auto pool takes 85% of free GPU memory,
    # check engine_stats' swaps_out/recomputes), so no host swap pool: pinning the auto-sized one
    # (16 GiB on the H200 machine) costs ~5 s and buys nothing here. bench_offload.py measures
    # the pool under pressure.
    config.setdefault("cpu_offload_gib", 0)
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(**config))
    init_s = time.perf_counter() - t0
    if next(model.parameters()).is_cuda:      # graph capture and Triton compiles: see above
        engine.generate(*warmup_params(prompts, outputs, True))
    params = [SamplingParams(max_new_tokens=n) for n in outputs]
    times, tokens = [], []
    for _ in range(2):          # the user's first call, then the same call again
        # The repeat must not find the prompts in the prefix cache (64 chat prompts: 3.2k of
        # prefill left 415 tokens): it would time less work than the first call did.
        engine.reset_prefix_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
        tokens.append([o.token_ids for o in outs])
    stats = dict(engine.stats(), engine_init_s=init_s, first_call_s=times[0][0],
                 steady_call_s=times[1][0], first_over_steady=times[0][0] / times[1][0],
                 first_call_same_tokens=tokens[0] == tokens[1])
    # On a GPU the engine's KV pool takes 85% of free memory: hand it back to the driver, or
    # the contenders after it (which size their caches from free memory) find none.
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times[1], tokens[1], stats


def run_generate_batch(model, prompts, outputs, cb_config=None):
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=None,
                           pad_token_id=0)
    hints = WorkloadHints(max(map(len, prompts)), max(outputs), len(prompts))
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb_config, block=True, timeout=5,
            workload_hints=hints) as manager:
        t0, c0 = time.perf_counter(), time.process_time()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, outputs)]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("generate_batch's thread stopped early")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"generate_batch failed {len(errors)} requests: {errors[0]}")
    return (seconds, cpu), [results[i].generated_tokens for i in ids]


@torch.inference_mode()
def run_padded_generate(model, prompts, outputs):
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs),
                         min_new_tokens=max(outputs), do_sample=False).cpu()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (seconds, cpu), [out[i, width:width + n].tolist() for i, n in enumerate(outputs)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 short requests (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--requests", "--num-requests", dest="requests", type=int, default=None,
                   help="number of requests (default 64, 16 with --quick)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--model", choices=MODELS, default="tiny-llama")
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="tiny",
                   help="shape of the random Llama of --model tiny-llama (llama-1b: Llama-3.2-1B's, "
                        "on CPU read from a bf16 checkpoint written once)")
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="default: mixed for tiny-llama, chat for smollm2-135m")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM's CPU build (bench/vllm_cpu.py; its venv is created on "
                        "first use) on the same checkpoint and prompts, after the other rounds")
    p.add_argument("--skip", default="", help="comma list of contenders to skip: "
                   "hf_default,hf_tuned,padded,cold,scheduler")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all contenders; each reports its best round")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice); 1 gives stable numbers on a "
                        "machine shared with other jobs")
    p.add_argument("--pressure", action="store_true",
                   help="instead: the memory-pressure workload of bench/bench_offload.py (swap vs "
                        "recompute vs transformers' offloading)")
    p.add_argument("--overlap", action="store_true",
                   help="instead: step time split with overlap on vs off (bench/bench_overlap.py; "
                        "uses --quick, --device, --dtype, --model-shape, --requests, --repeats)")
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.pressure:
        from bench_offload import run_pressure
        rows = run_pressure("cuda" if torch.cuda.is_available() else "cpu",
                            num_prompts=args.requests or (8 if args.quick else 32),
                            max_new_tokens=32 if args.quick else 64)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"pressure": rows}, f, indent=2)
        return 0
    if args.overlap:
        from bench_overlap import run as run_overlap
        rows = run_overlap(args.device, args.quick, args.model_shape, DTYPES[args.dtype],
                           args.requests, max(args.repeats, 2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {"bench": "overlap", "device": args.device}, "rows": rows}, f,
                      indent=2)
        return 0 if all(r["identical_tokens"] for r in rows) else 1
    logging.basicConfig(level=logging.WARNING)
    kind = args.workload or ("chat" if args.model == "smollm2-135m" or
                             args.model_shape == "llama-1b" else "mixed")
    skip = set(filter(None, args.skip.split(",")))
    if args.device == "cuda":
        skip.add("cold")      # the cold start measures the CPU build of the tiny model
    if args.model == "tiny-llama" and args.model_shape == "llama-1b" and args.device == "cpu":
        args.model = "llama-1b"     # the checkpoint written once (a GPU builds it in place)
    if args.model == "tiny-llama":
        model, tokenizer, saved_dir = build_model(shape=args.model_shape, device=args.device,
                                                  dtype=DTYPES[args.dtype]), None, None
    else:
        model, tokenizer, saved_dir = load_model(args.model, DTYPES[args.dtype])
        model = model.to(device=args.device)
    try:
        prompts, outputs = workload(kind, args.requests, args.quick, model.config.vocab_size,
                                    tokenizer)
    except ValueError as err:
        p.error(str(err))
    n, useful = len(prompts), sum(outputs)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
           "threads": torch.get_num_threads(), "model_name": args.model, "workload": kind,
           "requests": n, "output_tokens": useful, "prompt_tokens": sum(map(len, prompts)),
           "model": {k: getattr(model.config, k, None) for k in MODEL_SHAPES["llama-1b"]},
           "results": {},
           "load_before": os.getloadavg(),
           "meta": {"device": args.device, "dtype": args.dtype, "model": args.model,
                    "model_shape": args.model_shape, "workload": kind, "requests": n,
                    "output_tokens": useful}}

    def record(name, run, ref):
        """Time one contender; a failing one (e.g. an HF API this transformers lacks) is
        recorded with its error and the others still run. Returns its tokens or None."""
        try:
            (seconds, cpu), tokens = run()
        except Exception as e:
            print(f"{name:>22}: FAILED: {type(e).__name__}: {e}", flush=True)
            res["errors"][name] = f"{type(e).__name__}: {e}"
            return None
        match = sum(a == b for a, b in zip(tokens, ref)) if ref is not None else None
        best = res["results"].get(name)
        if best is not None:      # keep the best round of each contender (by wall time)
            best["rounds"] += 1
        if best is None or seconds < best["seconds"]:
            res["results"][name] = {"seconds": seconds, "cpu_seconds": cpu,
                                    "tok_per_s": useful / seconds, "tok_per_cpu_s": useful / cpu,
                                    "identical_requests": match,
                                    "rounds": best["rounds"] if best else 1}
        print(f"{name:>22}: {useful / seconds:8.1f} tok/s wall ({seconds:6.2f} s), "
              f"{useful / cpu:8.1f} tok/s of process CPU time ({cpu:6.2f} s)"
              + (f", identical tokens {match}/{n}" if match is not None else ""), flush=True)
        write_json(res, args.json)      # after each contender: a timeout keeps what finished
        return tokens

    res["errors"] = {}
    for _ in range(args.repeats):   # rounds alternate the contenders: load drifts hit all alike
        ours = record("cb_kernels", lambda: run_engine_stats(res, model, prompts, outputs), None)
        if "padded" not in skip:
            record("padded_generate", lambda: run_padded_generate(model, prompts, outputs), ours)
        if "hf_default" not in skip:
            record("generate_batch_default", lambda: run_generate_batch(model, prompts, outputs),
                   ours)
        if "hf_tuned" not in skip:
            record("generate_batch_tuned", lambda: run_generate_batch(
                model, prompts, outputs, tuned_hf_config()), ours)
    res["load_after_rounds"] = os.getloadavg()
    if args.vllm:
        run_vllm_row(res, model, saved_dir, prompts, outputs, ours, args.repeats, args.dtype)
    add_ratios(res)
    from engine_probes import cold_start_ttft, scheduler_step_ms

    if "scheduler" not in skip:
        res["scheduler_256"] = scheduler_step_ms()
        print("scheduler at 256 running: {schedule_ms:.3f} ms schedule + {pack_inputs_ms:.3f} ms "
              "input packing per step".format(**res["scheduler_256"]))
    if "cold" not in skip:
        res["cold_start"] = cold_start_ttft()
        print("cold start to first token: {ttft_in_process_s:.2f} s in process ({imports_s:.2f} "
              "imports, {model_build_s:.2f} random model build, {engine_init_s:.2f} Engine(), "
              "{first_step_s:.2f} first step), {wall_s:.2f} s wall".format(**res["cold_start"]))
    write_json(res, args.json)
    return 0 if "cb_kernels" in res["results"] else 1


def run_engine_stats(res, model, prompts, outputs):
    times, tokens, stats = run_engine(model, prompts, outputs)
    res["engine_stats"] = stats
    row = {k: stats[k] for k in ("engine_init_s", "first_call_s", "steady_call_s",
                                 "first_over_steady", "first_call_same_tokens")}
    res.setdefault("first_call", []).append(row)
    print(f"{'first call / steady':>22}: {row['first_call_s']:.2f} s / {row['steady_call_s']:.2f} s"
          f" = {row['first_over_steady']:.3f}x (Engine() {row['engine_init_s']:.2f} s, same "
          f"tokens: {row['first_call_same_tokens']})", flush=True)
    return times, tokens


def tuned_hf_config():
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(max_batch_tokens=512, num_blocks=64)


def add_ratios(res) -> None:
    """Ratios against padded generate and vLLM-CPU of the same run (wall, and CPU time where
    both sides have it)."""
    for ref, key in (("padded_generate", "vs_padded_generate"), ("vllm_cpu", "vs_vllm_cpu")):
        base = res["results"].get(ref)
        if not base:
            continue
        for r in res["results"].values():
            r[key] = r["tok_per_s"] / base["tok_per_s"]
            if "tok_per_cpu_s" in r and "tok_per_cpu_s" in base:
                r[key + "_cpu"] = r["tok_per_cpu_s"] / base["tok_per_cpu_s"]
        print(f"ratios vs {ref} (wall" + (" | CPU time" if "tok_per_cpu_s" in base else "")
              + "): " + ", ".join(f"{k} {v[key]:.2f}x" + (f" | {v[key + '_cpu']:.2f}x"
                                                           if key + "_cpu" in v else "")
                                  for k, v in res["results"].items()))


def run_vllm_row(res, model, saved_dir, prompts, outputs, ours, repeats,
                 dtype: str = "float32") -> None:
    """vLLM-CPU in its own venv and process (bench/vllm_cpu.py), after the in-process rounds:
    its OpenMP threads are bound to the cores, so it must not overlap the other contenders."""
    from contextlib import ExitStack

    from vllm_cpu import compare_with_vllm

    with ExitStack() as stack:
        row = compare_with_vllm(checkpoint_dir(model, saved_dir, stack), prompts, outputs,
                                expected_token_ids=ours, repeats=repeats, dtype=dtype)
    row.pop("token_ids", None)
    res["vllm_cpu"] = row
    if "error" in row:
        print(f"{'vllm_cpu':>22}: failed: {row['error'][-500:]}", flush=True)
        res["errors"]["vllm_cpu"] = row["error"][-500:]
        return
    res["results"]["vllm_cpu"] = {
        "seconds": row["generate_s"], "tok_per_s": row["tokens_per_s"],
        "identical_requests": row["matches_expected"], "rounds": repeats,
        "token_prefix_share": row["prefix_share"], "startup_s": row["startup_s"], "dtype": dtype,
        "requests_changed_between_repeats": row.get("requests_changed_between_repeats", 0)}
    print(f"{'vllm_cpu':>22}: {row['tokens_per_s']:8.1f} tok/s wall ({row['generate_s']:6.2f} s; "
          f"start-up {row['startup_s']:.0f} s), identical tokens {row['matches_expected']}/"
          f"{len(prompts)}, {100 * row['prefix_share']:.1f}% of our tokens before each "
          "request's first difference", flush=True)


def write_json(res, path) -> None:
    """The whole result, plus {meta, rows} for bench/summarize.py (one row per contender), through
    a temporary file and a rename (a run stopped mid-write leaves the previous whole file)."""
    res["rows"] = [{"contender": k, **v} for k, v in res["results"].items()]
    res["rows"] += [{"contender": k, "error": e} for k, e in res.get("errors", {}).items()]
    if path:
        write_json_file(path, res)


if __name__ == "__main__":
    sys.exit(main())
