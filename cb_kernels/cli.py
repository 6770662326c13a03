"""`cb-kernels` command line (also `python -m cb_kernels`).

    cb-kernels info                     versions, backends, GPU
    cb-kernels demo                     the real-model demo (see README)
    cb-kernels generate --model M ...   batch generation over a jsonl file
    cb-kernels serve --model M ...      an OpenAI-compatible HTTP server (the `serve` extra)
    cb-kernels bench paged_attention|write_kv|copy_blocks|swap_blocks|greedy_head [args]
                                        kernel benchmarks, shipped in the package
                                        (cb_kernels/benchmarks/<name>.py): work from a wheel
    cb-kernels bench attention [args]   = bench paged_attention
    cb-kernels bench cache [args]       swap_blocks, copy_blocks and write_kv in turn (their common
                                        options only; --json PATH writes PATH.<op>.json per bench)
    cb-kernels bench engine|dropin|offload|overlap|serve [args]
                                        engine benchmarks: source tree only (bench/bench_<name>.py
                                        of a checkout or an editable install)
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from cb_kernels.benchmarks import KERNEL_BENCHES

# Kernel benchmarks ship in cb_kernels/benchmarks; the engine ones need the source tree's bench/.
SOURCE_BENCHES = ("engine", "dropin", "offload", "overlap", "serve")
BENCHES = KERNEL_BENCHES + SOURCE_BENCHES
# Group names: `attention` runs paged_attention, `cache` the three cache-op benches.
BENCH_ALIASES = {"attention": ("paged_attention",), "cache": ("swap_blocks", "copy_blocks", "write_kv")}


def _bench_dir() -> Path:
    # Benchmarks live in the source tree's bench/ folder (an editable install or a checkout).
    here = Path(__file__).resolve().parent.parent / "bench"
    if not here.is_dir():
        raise SystemExit(f"cb-kernels bench {'|'.join(SOURCE_BENCHES)} needs the source tree: "
                         "these benchmarks live in its bench/ folder (clone the repository and "
                         "`pip install -e .`); the kernel benchmarks (" + ", ".join(KERNEL_BENCHES)
                         + ") ship with the package")
    return here


def _cmd_info(args: argparse.Namespace) -> int:
    from cb_kernels.info import collect, format_info

    print(format_info(collect()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    names = BENCH_ALIASES.get(args.which, (args.which,))
    for name in names:
        rest = list(args.rest)
        if len(names) > 1 and "--json" in rest[:-1]:    # one JSON file per bench of an alias
            i = rest.index("--json") + 1
            rest[i] = f"{rest[i]}.{name}.json"
        if name in KERNEL_BENCHES:
            from cb_kernels.benchmarks import run

            rc = run(name, rest)
        else:
            rc = _run_source_bench(name, rest)
        if rc:
            return rc
    return 0


def _run_source_bench(name: str, argv: list[str]) -> int:
    script = _bench_dir() / f"bench_{name}.py"
    if not script.exists():
        raise SystemExit(f"benchmark {script} does not exist yet")
    sys.argv = [str(script), *argv]
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:     # the scripts end with sys.exit(main())
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from cb_kernels.demo import run_demo

    return run_demo(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from cb_kernels.generate_cli import run_generate

    return run_generate(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from cb_kernels.serve.server import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cb-kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, backends and GPU").set_defaults(fn=_cmd_info)

    b = sub.add_parser("bench", help="run a benchmark (kernel ones ship with the package; "
                       "engine, dropin, offload, overlap, serve need the source tree's bench/)")
    b.add_argument("which", choices=BENCHES + tuple(BENCH_ALIASES))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    b.set_defaults(fn=_cmd_bench)

    try:
        from cb_kernels.demo import add_demo_args
    except ImportError:
        add_demo_args = None
    d = sub.add_parser("demo", help="generate with a real small model and compare with transformers")
    if add_demo_args:
        add_demo_args(d)
    d.set_defaults(fn=_cmd_demo)

    try:
        from cb_kernels.generate_cli import add_generate_args
    except ImportError:
        add_generate_args = None
    g = sub.add_parser("generate", help="generate for every prompt of a jsonl file")
    if add_generate_args:
        add_generate_args(g)
    g.set_defaults(fn=_cmd_generate)

    from cb_kernels.serve.server import add_serve_args   # argparse only: no extra needed
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine")
    add_serve_args(sv)
    sv.set_defaults(fn=_cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
