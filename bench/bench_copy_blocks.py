"""Entry point of the copy_blocks benchmark, which ships with the package
(cb_kernels/benchmarks/copy_blocks.py, also `cb-kernels bench copy_blocks`); same flags and outputs.

    python bench/bench_copy_blocks.py --help
"""
from _entry import run

if __name__ == "__main__":
    run("copy_blocks")
