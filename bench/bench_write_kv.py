"""Entry point of the write_kv benchmark, which ships with the package
(cb_kernels/benchmarks/write_kv.py, also `cb-kernels bench write_kv`); same flags and outputs.

    python bench/bench_write_kv.py --help
"""
from _entry import run

if __name__ == "__main__":
    run("write_kv")
