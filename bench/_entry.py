"""Runs a kernel benchmark that ships with the package (cb_kernels/benchmarks/<op>.py) from this
checkout: the checkout's cb_kernels wins over an installed one."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def run(op: str) -> None:
    import importlib

    sys.exit(importlib.import_module(f"cb_kernels.benchmarks.{op}").main(sys.argv[1:]))
