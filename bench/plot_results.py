"""PNG plots for bench/RESULTS.md from the benchmarks' JSON output.

    python bench/plot_results.py --attention A.json [--engine E.json ...] --out bench/plots

- attention: decode GB/s against context length, one line per (backend, batch), with the
  copy bandwidth measured in the same run drawn as the ceiling.
- engine: output tokens/s of each contender (one panel per JSON file), with the ratio to padded
  `generate` on each bar.
Needs matplotlib (`pip install -e ".[bench]"`).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def plot_attention(path: Path, out: Path) -> Path:
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r["shape"].startswith("decode")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines: dict[tuple, list] = {}
    for r in rows:
        batch, ctx = map(int, re.match(r"decode b(\d+) ctx(\d+)", r["shape"]).groups())
        key = (r["backend"], r.get("threads"), batch)
        lines.setdefault(key, []).append((ctx, r["gbps"]))
    for (backend, threads, batch), pts in sorted(lines.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        label = f"{backend} b{batch}" + (f" {threads}t" if threads else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ceiling = statistics.median(r["copy_gbps"] for r in rows)
    ax.axhline(ceiling, color="k", linestyle="--", label=f"copy, same run ({ceiling:.0f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("achieved GB/s (q + K/V + out)")
    ax.set_title(f"paged_attention decode ({path.stem})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    dst = out / f"{path.stem}_decode.png"
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    return dst


def plot_engine(paths: list[Path], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4), squeeze=False)
    for ax, path in zip(axes[0], paths):
        results = json.loads(path.read_text())["results"]
        names = list(results)
        tps = [results[n]["tok_per_s"] for n in names]
        bars = ax.bar(range(len(names)), tps, color=["tab:green" if n == "cb_kernels" else "tab:gray"
                                                     for n in names])
        for bar, n in zip(bars, names):
            ratio = results[n].get("vs_padded_generate")
            if ratio is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{ratio:.2f}x",
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_ylabel("output tokens/s")
        ax.set_title(path.stem, fontsize=9)
    fig.suptitle("engine throughput (labels: ratio to padded generate, same run)", fontsize=9)
    fig.tight_layout()
    dst = out / "engine_throughput.png"
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", type=Path, nargs="*", default=[], help="bench_attention JSON files")
    p.add_argument("--engine", type=Path, nargs="*", default=[], help="bench_engine JSON files")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "plots")
    args = p.parse_args(argv)
    if not args.attention and not args.engine:
        p.error("give --attention and/or --engine JSON files")
    args.out.mkdir(parents=True, exist_ok=True)
    made = [plot_attention(a, args.out) for a in args.attention]
    if args.engine:
        made.append(plot_engine(args.engine, args.out))
    for m in made:
        print(m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
