"""Print every benchmark JSON of a results folder as markdown tables (used by gpu_check.sh and to
refresh bench/RESULTS.md).

    python bench/summarize.py RESULTS_DIR

A benchmark JSON holds its rows as a list under "rows" or "pressure" (columns print in the order
of the first row), or as a dict of contenders under "results" (bench_engine.py); "meta" or
"config" is printed above the table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    for r in rows[1:]:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _rows(data) -> list[dict]:
    if isinstance(data, list):
        return data
    for key in ("rows", "pressure"):
        if isinstance(data.get(key), list):
            return data[key]
    if isinstance(data.get("results"), dict):
        return [{"contender": k, **v} for k, v in data["results"].items() if isinstance(v, dict)]
    return []


def summarize(folder: Path) -> str:
    parts = []
    for path in sorted(folder.glob("*.json")):
        try:     # a stage killed while writing leaves a broken file: report it, go on
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            parts += [f"### {path.stem}\n", f"(unreadable: {e})", ""]
            continue
        rows, meta = _rows(data), {}
        if isinstance(data, dict):
            meta = data.get("meta") or data.get("config") or {}
        parts.append(f"### {path.stem}\n")
        if meta:
            parts.append(", ".join(f"{k}: {_fmt(v)}" for k, v in meta.items()) + "\n")
        parts.append(table(rows) if rows else "(no rows)")
        parts.append("")
    return "\n".join(parts) if parts else f"no benchmark JSON in {folder}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(summarize(Path(sys.argv[1])))
