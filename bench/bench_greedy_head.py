"""Entry point of the greedy_head benchmark, which ships with the package
(cb_kernels/benchmarks/greedy_head.py, also `cb-kernels bench greedy_head`); same flags and outputs.

    python bench/bench_greedy_head.py --help
"""
from _entry import run

if __name__ == "__main__":
    run("greedy_head")
