"""ops.sample_tokens (csrc/cpu/sample_tokens.cpp) against its torch reference, the sampler's
earlier path (ref_sample_tokens: shift and scale, log_softmax, exp, cumsum, searchsorted), on a
GRPO step's logits: `--rows` x SmolLM2's vocabulary (49152), fp32, temperature 1 or not.

    python bench/bench_sample_tokens.py --threads 1 [--rows 512] [--temperature 0.7]

Prints ms per call of each and the ratio (median of --repeats, both in the same run), and in how
many rows the two drew the same token (they differ only where the target sits within the
reference's fp32 cumsum rounding of a column boundary).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import cb_kernels  # noqa: E402,F401  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402

from cb_kernels.ops import sample_tokens  # noqa: E402
from cb_kernels.ops.reference import ref_sample_tokens  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.vocab, generator=g) * 3
    u = torch.rand(args.rows, generator=g).clamp(1e-7, 1 - 1e-7)
    t = None if args.temperature == 1 else torch.full((args.rows,), args.temperature)
    same = int((sample_tokens(x, u, t)[0] == ref_sample_tokens(x, u, t)[0]).sum())
    ref = median_ms(lambda: ref_sample_tokens(x, u, t), args.repeats)
    ours = median_ms(lambda: sample_tokens(x, u, t), args.repeats)
    print(f"{args.rows} x {args.vocab} fp32, temperature {args.temperature}, {args.threads} "
          f"thread(s), load {os.getloadavg()[0]:.1f}: reference {ref:.1f} ms, sample_tokens "
          f"{ours:.1f} ms ({ref / ours:.1f}x); same tokens in {same} of {args.rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
