"""Entry point of the copy_blocks benchmark; the benchmark itself ships with the package
(cb_kernels/benchmarks/copy_blocks.py, also `cb-kernels bench copy_blocks`). Same flags and outputs.

    python bench/bench_copy_blocks.py --help
"""
import os
import sys

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cb_kernels.benchmarks.copy_blocks import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
