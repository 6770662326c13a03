"""Tensor parallelism on one CPU machine: TP=2 (2 processes, gloo) against TP=1, and what the
collectives cost per step.

    python bench/bench_tp.py [--quick] [--json bench/data/tp_cpu.json]

A random Llama (default hidden 1024, 8 layers, 16/8 heads, MLP 2816, vocab 32000, fp32: 150M
parameters), one greedy workload (16 prompts x 64 tokens, 32 new tokens each, no EOS) after a
warm-up run, through:
  TP=1, 1 thread      the one-process engine on one core
  TP=1, 2 threads     the one-process engine on both cores (what TP=2 competes with here)
  TP=2, 1 thread/rank  2 processes (engine/launcher.spawn), each half of every layer, through
                      Engine(model, config, runner=build_runner(model, config)) on each
  TP=2, no collectives the same with the model's all_reduce/all_gather skipped (local_only):
                      each rank's compute alone, an upper bound (its tokens are wrong)
Per row: wall time per step and generated tokens/s; for TP=2, rank 0's time inside each kind of
collective per step (timed around torch.distributed's calls; it includes waiting for the other
rank to arrive, so it is the cost of being in step, not only of moving bytes), calls per step,
and the all_reduce of one decode step's [16, hidden] fp32 activations: its median inside the
steps, and bare (both ranks at it already, after a barrier; median of 200) for the transport
alone. Tokens of every row are checked equal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import cb_kernels  # noqa: E402,F401  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402


def make_model(a):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=a.hidden, intermediate_size=a.inter,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def workload(a):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, a.vocab, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.num_prompts)]
    return prompts


def run(engine, a, timer=None):
    """(outputs, wall seconds, steps) of the workload, after a warm-up; `timer` (entered around
    the timed run only)."""
    import contextlib

    from cb_kernels import SamplingParams

    prompts = workload(a)
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.generate(prompts[:4], warm)
    before = engine.stats()["steps"]
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    with timer if timer is not None else contextlib.nullcontext():
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    steps = engine.stats()["steps"] - before if engine.rank == 0 else 0
    return outs, wall, steps


class CollectiveTimer:
    """Wraps torch.distributed's collectives, summing seconds and calls per name."""

    NAMES = ("all_reduce", "all_gather", "broadcast")

    def __init__(self):
        self.seconds, self.calls, self.saved = defaultdict(float), defaultdict(int), {}
        self.reduce_by_size = defaultdict(list)  # model sum (all_reduce_) numel -> seconds each

    def __enter__(self):
        import cb_kernels.runner.fused.forward as fused
        from cb_kernels.runner import tensor_parallel

        dist = torch.distributed
        real_sum = tensor_parallel.all_reduce_

        def timed_sum(x, info):
            t = time.perf_counter()
            try:
                return real_sum(x, info)
            finally:
                self.reduce_by_size[x.numel()].append(time.perf_counter() - t)
        self.sum_modules = (tensor_parallel, fused)
        for m in self.sum_modules:
            m.all_reduce_ = timed_sum
        self.real_sum = real_sum
        for name in self.NAMES:
            real = self.saved[name] = getattr(dist, name)

            def timed(*args, _real=real, _name=name, **kwargs):
                t = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t
                    self.seconds[_name] += dt
                    self.calls[_name] += 1
            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(torch.distributed, name, real)
        for m in self.sum_modules:
            m.all_reduce_ = self.real_sum


def _rank(rank, a, queue):
    from cb_kernels import Engine, EngineConfig
    from cb_kernels.engine.distributed import build_runner

    config = EngineConfig(tensor_parallel_size=2, max_num_seqs=a.num_prompts)
    model = make_model(a)
    runner = build_runner(model, config)          # this rank's DriverRunner / FollowerRunner
    engine = Engine(model, config, runner=runner)
    timer = CollectiveTimer()
    outs, wall, steps = run(engine, a, timer)
    # The same run with the model's collectives off (the step broadcasts stay, so the ranks keep
    # in step): each rank's compute alone. Its tokens are wrong, by construction.
    from cb_kernels.runner import tensor_parallel
    with tensor_parallel.local_only():
        _, local_wall, _ = run(engine, a)
    size, calls = max(timer.reduce_by_size.items(), key=lambda kv: len(kv[1]))
    x = torch.randn(size // a.hidden, a.hidden)
    group = runner.channel.group
    times = []
    for _ in range(200):
        torch.distributed.barrier(group=group)
        t = time.perf_counter()
        tensor_parallel.all_reduce_(x, tensor_parallel.info_of(model))
        times.append(time.perf_counter() - t)
    queue.put((rank, {
        "tokens": [o.token_ids for o in outs], "wall_s": wall, "steps": steps,
        "collective_s": dict(timer.seconds), "collective_calls": dict(timer.calls),
        "bare_all_reduce_us": statistics.median(times) * 1e6,
        "in_step_all_reduce_us": statistics.median(calls) * 1e6,
        "all_reduce_rows": size // a.hidden,
        "local_wall_s": local_wall, "fused": runner.local.fused is not None}))


GATHER = "2**20"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--inter", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="a 4-layer hidden-512 model, 8 new tokens")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.inter, a.layers, a.heads, a.kv_heads, a.new_tokens = 512, 1408, 4, 8, 4, 8
    from cb_kernels import Engine, EngineConfig
    from cb_kernels.engine import launcher
    import torch.multiprocessing as mp

    rows = {}
    model = make_model(a)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        engine = Engine(model, EngineConfig(max_num_seqs=a.num_prompts))
        outs, wall, steps = run(engine, a)
        rows[f"TP=1, {threads} thread{'s' if threads > 1 else ''}"] = {
            "tokens": [o.token_ids for o in outs], "wall_s": wall, "steps": steps}
        del engine
    del model
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = launcher.free_port()
    procs = [ctx.Process(target=launcher._rank_main,
                         args=(r, 2, port, 300.0, 1, _rank, (a, queue))) for r in range(2)]
    for proc in procs:
        proc.start()
    ranks = {}
    while len(ranks) < 2:
        try:
            rank, result = queue.get(timeout=5)
            ranks[rank] = result
        except Exception:                          # noqa: BLE001 (queue.Empty)
            if any(not proc.is_alive() and proc.exitcode for proc in procs):
                for proc in procs:
                    proc.kill()
                raise SystemExit("a TP rank failed (its traceback is above)")
    for proc in procs:
        proc.join()
    rows["TP=2, 1 thread/rank"] = ranks[0]

    base = rows["TP=1, 2 threads"]
    tokens = a.num_prompts * a.new_tokens
    print(f"model: Llama hidden {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} heads, MLP "
          f"{a.inter}, vocab {a.vocab}, fp32; {a.num_prompts} prompts x {a.prompt_len} tokens, "
          f"{a.new_tokens} new; fused forward under TP: {ranks[0]['fused']}")
    print(f"{'config':<22} {'ms/step':>8} {'tok/s':>8} {'vs TP=1 2thr':>12}")
    for name, r in rows.items():
        assert r["tokens"] == base["tokens"], f"{name}: tokens differ from TP=1"
        ms = r["wall_s"] / r["steps"] * 1e3
        print(f"{name:<22} {ms:8.2f} {tokens / r['wall_s']:8.1f} "
              f"{base['wall_s'] / r['wall_s']:11.2f}x")
    r0, r1 = ranks[0], ranks[1]
    steps = r0["steps"]
    print(f"{'TP=2, no collectives':<22} {r0['local_wall_s'] / steps * 1e3:8.2f} "
          f"{tokens / r0['local_wall_s']:8.1f} {base['wall_s'] / r0['local_wall_s']:11.2f}x"
          "   (compute alone: wrong tokens)")
    print(f"TP=2 collectives per step (rank 0; {steps} steps; time includes waiting for rank 1):")
    for name in CollectiveTimer.NAMES:
        for rank, r in ((0, r0), (1, r1)):
            s, n = r["collective_s"].get(name, 0.0), r["collective_calls"].get(name, 0)
            print(f"  rank {rank} {name:<11} {n / steps:6.1f} calls {s / steps * 1e3:8.3f} ms")
    total = sum(r0["collective_s"].values()) / steps * 1e3
    print(f"  rank 0 total {total:.3f} ms of {r0['wall_s'] / steps * 1e3:.2f} ms a step "
          f"({total / (r0['wall_s'] / steps * 1e3):.0%})")
    print(f"  model sum (all_reduce_: gloo all_gather + add up to {GATHER} elements) of a decode "
          f"step's [{r0['all_reduce_rows']}, {a.hidden}] fp32: "
          f"{r0['in_step_all_reduce_us']:.0f} us inside the steps (median), "
          f"{r0['bare_all_reduce_us']:.0f} us bare (both ranks waiting for it; median of 200)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": {k: {kk: vv for kk, vv in v.items()
                                                     if kk != "tokens"} for k, v in rows.items()},
                       "rank1": {k: v for k, v in r1.items() if k != "tokens"}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
