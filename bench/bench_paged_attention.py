"""Entry point of the paged_attention benchmark, which ships with the package
(cb_kernels/benchmarks/paged_attention.py, also `cb-kernels bench paged_attention`); same flags and outputs.

    python bench/bench_paged_attention.py --help
"""
from _entry import run

if __name__ == "__main__":
    run("paged_attention")
