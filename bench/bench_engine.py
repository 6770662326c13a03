"""Engine throughput against transformers (and optionally vLLM-CPU) on the same prompts
(greedy, fp32, one process).

    python bench/bench_engine.py [--quick] [--json out.json]
    python bench/bench_engine.py --workload fixed --vllm --repeats 2 --threads 2   # issue 5, tiny Llama
    python bench/bench_engine.py --model smollm2-135m --vllm --repeats 2 --threads 2  # 16 chat x 64

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
Output tokens/s counts the requested tokens; ratios are against padded generate (and vLLM-CPU)
measured in the same run, by wall time and by this process's CPU time (on a machine shared with
other jobs the CPU-time ratio is the stable one; with --threads 1 it is the single-core cost
ratio). Also: the scheduler's time per step at 256 running requests (schedule + input packing,
no model) and the time to first token of a fresh process.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time

import torch

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import (MODELS, TINY_LLAMA, WORKLOADS, build_tiny_llama,  # noqa: E402
                              checkpoint_dir, load_model, versions, workload)

build_model = build_tiny_llama     # the cold-start child imports it under this name


def run_engine(model, prompts, outputs, **config):
    from cb_kernels import Engine, EngineConfig, SamplingParams

    engine = Engine(model, EngineConfig(**config))
    engine.generate([p[:8] for p in prompts[:4]], SamplingParams(max_new_tokens=4))   # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in outputs])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (seconds, cpu), [o.token_ids for o in outs], engine.stats()


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
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs),
                         min_new_tokens=max(outputs), do_sample=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (seconds, cpu), [out[i, width:width + n].tolist() for i, n in enumerate(outputs)]


def scheduler_step_ms(num_running: int = 256, steps: int = 200) -> dict:
    """Time of schedule() + postprocess bookkeeping + input packing with `num_running` decoding
    requests of ~300 tokens (blocks of 16), no model."""
    from cb_kernels.engine.block_manager import BlockManager
    from cb_kernels.engine.config import SamplingParams
    from cb_kernels.engine.scheduler import Scheduler
    from cb_kernels.engine.sequence import Sequence
    from cb_kernels.hf.adapter import ModelAdapter

    bm = BlockManager(num_running * 40, 16)
    sched = Scheduler(bm, max_batch_tokens=512, max_num_seqs=num_running)
    rng = random.Random(0)
    for i in range(num_running):
        sched.add(Sequence(i, f"r{i}", [rng.randrange(32000) for _ in range(rng.randint(200, 400))],
                           SamplingParams(max_new_tokens=10_000)))
    while any(not s.is_decoding for s in sched.running) or sched.waiting:
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(1)
    packer = ModelAdapter.__new__(ModelAdapter)       # prepare() needs only these fields
    packer.block_size, packer.device = 16, torch.device("cpu")
    packer.k_caches = packer.v_caches = []
    packer.sliding_windows, packer.softcap, packer.attention_backend = [], None, None
    t_sched = t_pack = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        packer.prepare(batch.seqs, batch.num_new_tokens)
        t2 = time.perf_counter()
        for s in batch.seqs:
            s.num_computed_tokens += 1
            s.token_ids.append(1)
        t_sched += t1 - t0
        t_pack += t2 - t1
    assert len(batch.seqs) == num_running
    return {"schedule_ms": 1e3 * t_sched / steps, "pack_inputs_ms": 1e3 * t_pack / steps}


COLD = """
import json, time
t0 = time.perf_counter()
import torch, transformers
from cb_kernels import Engine, EngineConfig, SamplingParams
import bench_engine as b
t1 = time.perf_counter()
model = b.build_model()
t2 = time.perf_counter()
engine = Engine(model, EngineConfig())
rid = engine.add_request(list(range(1, 129)), SamplingParams(max_new_tokens=2))
t3 = time.perf_counter()
while not engine._seqs[rid].output_token_ids:
    engine.step()
t4 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "model_build_s": t2 - t1, "engine_init_s": t3 - t2,
                  "first_step_s": t4 - t3, "ttft_in_process_s": t4 - t0}))
"""


def cold_start_ttft() -> dict:
    """A fresh interpreter to the first token of a 128-token prompt: imports, random model
    construction (transformers' weight init, not ours), Engine() with auto sizing (allocates the
    KV pool), and the first step (one-time kernel and allocator warm-up included)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here),
                                                       os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, env=env,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


def run_vllm_row(model, saved_dir, prompts, outputs, ours, repeats):
    """vLLM-CPU in its own venv and process (bench/vllm_cpu.py), after the in-process rounds:
    its OpenMP threads are bound to the cores, so it must not overlap the other contenders."""
    from contextlib import ExitStack

    from vllm_cpu import compare_with_vllm

    with ExitStack() as stack:
        row = compare_with_vllm(checkpoint_dir(model, saved_dir, stack), prompts, outputs,
                                expected_token_ids=ours, repeats=repeats)
    if "error" in row:
        print(f"{'vllm_cpu':>22}: failed: {row['error'][-500:]}", flush=True)
        return row
    row.pop("token_ids")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 short requests (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--model", choices=MODELS, default="tiny-llama")
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="default: mixed for tiny-llama, chat for smollm2-135m")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--skip", default="", help="comma list of contenders to skip: "
                   "hf_default,hf_tuned,padded,cold,scheduler")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM's CPU build (bench/vllm_cpu.py; its venv is created on "
                        "first use) on the same checkpoint and prompts, after the other rounds")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over all contenders; each reports its best round")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice); 1 gives stable numbers on a "
                        "machine shared with other jobs")
    p.add_argument("--pressure", action="store_true",
                   help="instead: the memory-pressure workload of bench/bench_offload.py (swap vs "
                        "recompute vs transformers' offloading)")
    args = p.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        p.error(f"--requests must be >= 1, got {args.requests}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pressure:
        from bench_offload import run_pressure
        rows = run_pressure("cuda" if torch.cuda.is_available() else "cpu",
                            num_prompts=args.requests or (8 if args.quick else 32),
                            max_new_tokens=32 if args.quick else 64)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"pressure": rows}, f, indent=2)
        return 0
    logging.basicConfig(level=logging.WARNING)
    kind = args.workload or ("chat" if args.model == "smollm2-135m" else "mixed")
    skip = set(filter(None, args.skip.split(",")))
    model, tokenizer, saved_dir = load_model(args.model)
    try:
        prompts, outputs = workload(kind, args.requests, args.quick, model.config.vocab_size,
                                    tokenizer)
    except ValueError as err:
        p.error(str(err))
    n, useful = len(prompts), sum(outputs)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
           "threads": torch.get_num_threads(), "model_name": args.model, "workload": kind,
           "requests": n, "output_tokens": useful, "prompt_tokens": sum(map(len, prompts)),
           "model": {k: getattr(model.config, k, None) for k in TINY_LLAMA}, "results": {},
           "load_before": os.getloadavg()}

    def record(name, times, tokens, ref):
        seconds, cpu = times
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

    for _ in range(args.repeats):   # rounds alternate the contenders: load drifts hit all alike
        times, ours, stats = run_engine(model, prompts, outputs)
        res["engine_stats"] = stats
        record("cb_kernels", times, ours, None)
        if "padded" not in skip:
            record("padded_generate", *run_padded_generate(model, prompts, outputs), ours)
        if "hf_default" not in skip:
            record("generate_batch_default", *run_generate_batch(model, prompts, outputs), ours)
        if "hf_tuned" not in skip:
            from transformers import ContinuousBatchingConfig
            tuned = ContinuousBatchingConfig(max_batch_tokens=512, num_blocks=64)
            record("generate_batch_tuned", *run_generate_batch(model, prompts, outputs, tuned),
                   ours)
    res["load_after_rounds"] = os.getloadavg()
    if args.vllm:
        row = run_vllm_row(model, saved_dir, prompts, outputs, ours, args.repeats)
        res["vllm_cpu"] = row
        if "error" not in row:
            res["results"]["vllm_cpu"] = {
                "seconds": row["generate_s"], "tok_per_s": row["tokens_per_s"],
                "identical_requests": row["matches_expected"], "rounds": args.repeats,
                "startup_s": row["startup_s"]}
            print(f"{'vllm_cpu':>22}: {row['tokens_per_s']:8.1f} tok/s wall "
                  f"({row['generate_s']:6.2f} s; start-up {row['startup_s']:.0f} s), "
                  f"identical tokens {row['matches_expected']}/{n}", flush=True)
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
    if "scheduler" not in skip:
        res["scheduler_256"] = scheduler_step_ms()
        print("scheduler at 256 running: {schedule_ms:.3f} ms schedule + {pack_inputs_ms:.3f} ms "
              "input packing per step".format(**res["scheduler_256"]))
    if "cold" not in skip:
        res["cold_start"] = cold_start_ttft()
        print("cold start to first token: {ttft_in_process_s:.2f} s in process ({imports_s:.2f} "
              "imports, {model_build_s:.2f} random model build, {engine_init_s:.2f} Engine(), "
              "{first_step_s:.2f} first step), {wall_s:.2f} s wall".format(**res["cold_start"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
