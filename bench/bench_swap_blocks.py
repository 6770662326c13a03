"""Entry point of the swap_blocks benchmark, which ships with the package
(cb_kernels/benchmarks/swap_blocks.py, also `cb-kernels bench swap_blocks`); same flags and outputs.

    python bench/bench_swap_blocks.py --help
"""
from _entry import run

if __name__ == "__main__":
    run("swap_blocks")
