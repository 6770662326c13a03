"""`cb-kernels generate` on one engine (2 threads) against `--ray --replicas 2` (1 thread each)
on this machine, the Ray replicas fed one batch at a time (lockstep, --ray-batches-in-flight 1)
and continuously (2 batches in flight, the default), and what Ray Data costs per row.

    flock /tmp/cbk-heavy.lock python bench/bench_ray.py [--quick] [--vary] [--json FILE]

Each contender is the real command in its own process (`python -m cb_kernels generate ...`; the
Ray ones start their own local cluster, as a user's run does), timed from start to exit, on two
jobs of the same rows: a small one (start-up: Python, Ray, model loads, the first batch) and a
big one. The rate is (big rows - small rows) / (big wall - small wall): rows per second once
running, start-up subtracted. Rounds alternate the contenders (single, lockstep, continuous,
continuous x2, single, ...), best of the rounds kept; the load average is printed before each
run. Greedy, EOS off: the outputs are checked equal line by line. --vary gives each row its own
max_new_tokens (uniform in [8, 2 * --max-new-tokens - 8], as EOS would end rows at different
lengths): then a batch's rows end at different steps and lockstep leaves the engine part-empty
at its end.

--batch-size B is the rows a replica holds at once (`--ray-batch-size`), the most a killed
replica costs: lockstep holds one batch of B, continuous two of B/2 (the same rework bound);
"continuous x2" runs --ray-batch-size 2B (two batches of B in flight, twice the rework), which
is what continuous feeding held before the bound.

Ray's per-row overhead: the same Datasets (one JSON line per row, `batch_size` rows a batch, 2
actors) through an actor that returns its batch untouched, timed in this process after a warm-up
job, the small job's wall subtracted from the big one's: seconds per row, against the engine's
seconds per row.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_rows(path, count: int, vocab: int, seed: int = 0, vary_up_to: int = 0):
    import random

    rnd = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            ids = [rnd.randrange(1, vocab) for _ in range(rnd.randrange(16, 65))]
            row = {"id": f"q{i}", "prompt_token_ids": ids}
            if vary_up_to:
                row["max_new_tokens"] = rnd.randint(8, vary_up_to)
            f.write(json.dumps(row) + "\n")


# name -> (batches in flight per replica, --ray-batch-size in --batch-size's); None: no Ray
CONTENDERS = {"single": None, "lockstep": (1, 1), "ray": (2, 1), "ray_x2": (2, 2)}


def run_cli(a, src, dst, name: str) -> float:
    cmd = [sys.executable, "-m", "cb_kernels", "generate", "--model", a.model, "--input", str(src),
           "--output", str(dst), "--max-new-tokens", str(a.max_new_tokens), "--ignore-eos",
           "--dtype", a.dtype]
    if CONTENDERS[name] is not None:
        in_flight, times = CONTENDERS[name]
        cmd += ["--ray", "--replicas", "2", "--cpus-per-replica", "1",
                "--ray-batch-size", str(a.batch_size * times),
                "--ray-batches-in-flight", str(in_flight)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAY_DISABLE_USAGE_STATS="1")
    print(f"  load average {os.getloadavg()[0]:.2f}: {name} "
          f"{sum(1 for _ in open(src))} rows", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=_ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


class _Identity:
    def __call__(self, batch):
        return batch


def ray_overhead(rows: int, small_rows: int, batch_size: int, rounds: int) -> float:
    """Seconds per row Ray Data adds: the job's rows through 2 do-nothing actors, the small
    job's wall subtracted (job start-up is not per row)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False

    def job(count: int) -> float:
        items = [{"id": f"q{i}", "index": i, "record": json.dumps({"prompt_token_ids": [1] * 40})}
                 for i in range(count)]
        t0 = time.perf_counter()
        ds = ray.data.from_items(items, override_num_blocks=math.ceil(count / batch_size))
        ds = ds.map_batches(_Identity, batch_size=batch_size, num_cpus=1, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=2))
        n = sum(len(b["id"]) for b in ds.iter_batches(batch_size=None, batch_format="numpy"))
        assert n == count
        return time.perf_counter() - t0

    try:
        job(small_rows)                       # warms Ray's workers up
        walls = [(job(small_rows), job(rows)) for _ in range(rounds)]
        return max(0.0, min(big for _, big in walls) - min(s for s, _ in walls)) / (rows - small_rows)
    finally:
        ray.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--small-rows", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vary", action="store_true",
                   help="each row its own max_new_tokens in [8, 2 * --max-new-tokens - 8]")
    p.add_argument("--quick", action="store_true", help="64 rows, 8 new tokens, 1 round")
    p.add_argument("--work", default="/tmp/cbk_bench_ray")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.rows, a.max_new_tokens, a.rounds = 64, 8, 1
    os.makedirs(a.work, exist_ok=True)
    big, small = os.path.join(a.work, "big.jsonl"), os.path.join(a.work, "small.jsonl")
    vary = 2 * a.max_new_tokens - 8 if a.vary else 0
    write_rows(big, a.rows, a.vocab, vary_up_to=vary)
    write_rows(small, a.small_rows, a.vocab, seed=1, vary_up_to=vary)

    walls = {n: {"small": math.inf, "big": math.inf} for n in CONTENDERS}
    for _ in range(a.rounds):
        for job, src in (("small", small), ("big", big)):
            for name in CONTENDERS:
                dst = os.path.join(a.work, f"out_{name}_{job}.jsonl")
                walls[name][job] = min(walls[name][job], run_cli(a, src, dst, name))
    outs = {n: {json.loads(x)["id"]: x for x in open(os.path.join(a.work, f"out_{n}_big.jsonl"))}
            for n in CONTENDERS}
    same = {n: sum(outs["single"][k] == outs[n].get(k) for k in outs["single"]) for n in CONTENDERS}

    rate = {n: (a.rows - a.small_rows) / (w["big"] - w["small"]) for n, w in walls.items()}
    tokens = sum(json.loads(x).get("max_new_tokens", a.max_new_tokens) for x in open(big))
    per_row = ray_overhead(a.rows, a.small_rows, a.batch_size, a.rounds)
    result = dict(model=a.model, dtype=a.dtype, rows=a.rows, small_rows=a.small_rows,
                  max_new_tokens=a.max_new_tokens, vary_new_tokens_up_to=vary,
                  batch_size=a.batch_size, walls_s=walls, rows_per_s=rate,
                  ray_vs_single=rate["ray"] / rate["single"],
                  lockstep_vs_single=rate["lockstep"] / rate["single"],
                  ray_vs_lockstep=rate["ray"] / rate["lockstep"],
                  ray_x2_vs_lockstep=rate["ray_x2"] / rate["lockstep"],
                  identical_lines={n: f"{k}/{len(outs['single'])}" for n, k in same.items()},
                  ray_s_per_row=per_row,
                  ray_overhead_vs_single_row=per_row * rate["single"],
                  load_average_end=os.getloadavg()[0], cpu=open("/proc/cpuinfo").read()
                  .split("model name")[1].split("\n")[0].split(":", 1)[1].strip(), cores=os.cpu_count())
    for name in CONTENDERS:
        print(f"{name:8s}: start-up {walls[name]['small']:.1f} s, {a.rows} rows "
              f"{walls[name]['big']:.1f} s, {rate[name]:.2f} rows/s "
              f"({rate[name] * tokens / a.rows:.0f} tok/s) once running; identical lines "
              f"{result['identical_lines'][name]}")
    print(f"ray x2 continuous / single x2 threads: {result['ray_vs_single']:.2f}x; lockstep / "
          f"single: {result['lockstep_vs_single']:.2f}x; continuous / lockstep (both holding "
          f"{a.batch_size} rows a replica): {result['ray_vs_lockstep']:.2f}x; continuous "
          f"holding {2 * a.batch_size} / lockstep: {result['ray_x2_vs_lockstep']:.2f}x")
    if per_row > 0:
        print(f"Ray Data per row (do-nothing actors): {per_row * 1e3:.2f} ms = "
              f"{result['ray_overhead_vs_single_row'] * 100:.1f}% of a row's generation time")
    else:
        print("Ray Data per row (do-nothing actors): below resolution (the big job took no longer "
              "than the small one)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
