"""What following the weights costs a step: Engine.check_weights() (engine/weights.py's per-step
identity compare, plus the flag of torch's registration hooks) against a 16-request greedy
decode step of a random SmolLM2-135M-shaped model (fp32, the default runner), and the full tree
walk the check replaced. Interleaved in one run.

    python bench/bench_weight_watch.py --threads 2 --repeats 200
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cb_kernels  # noqa: E402  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402
from bench_sampling import build_model  # noqa: E402
from cb_kernels import Engine, EngineConfig, SamplingParams  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, "cpu", torch.float32)
    engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, overlap="off"))
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        engine.add_request(torch.randint(1, 49152, (32,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=1000, ignore_eos=True))
    for _ in range(3):          # prefill and warm up
        engine.step()
    steps = []
    for _ in range(max(5, args.repeats // 20)):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    steps.sort()
    step_ms = steps[len(steps) // 2] * 1e3
    check_ms = median_ms(engine.check_weights, args.repeats)
    walk_ms = median_ms(lambda: list(model.parameters()), args.repeats)
    n = len(engine.weights.params)
    print(f"params {n}  decode step (16 requests) {step_ms:.2f} ms  check_weights "
          f"{check_ms:.3f} ms ({100 * check_ms / step_ms:.2f}% of the step)  tree walk "
          f"{walk_ms:.3f} ms  threads {args.threads}")


if __name__ == "__main__":
    main()
