"""Entry point of the write_kv benchmark; the benchmark itself ships with the package
(cb_kernels/benchmarks/write_kv.py, also `cb-kernels bench write_kv`). Same flags and outputs.

    python bench/bench_write_kv.py --help
"""
import os
import sys

# Run from a checkout, the checkout's cb_kernels wins over an installed one.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from cb_kernels.benchmarks.write_kv import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
