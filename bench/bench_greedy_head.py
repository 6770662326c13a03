"""Entry point of the greedy_head benchmark; the benchmark itself ships with the package
(cb_kernels/benchmarks/greedy_head.py, also `cb-kernels bench greedy_head`). Same flags and outputs.

    python bench/bench_greedy_head.py --help
"""
import os
import sys

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cb_kernels.benchmarks.greedy_head import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
