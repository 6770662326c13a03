"""The bundle of bench/gpu_check.sh: DIR/summary.md and DIR/results.json from its work folder.

    python bench/gpu_check_report.py WORK DIR [MODE]

Standard library only (no torch import: it runs after every stage and every few seconds during
one). WORK holds stages.tsv (one line per finished stage: name, verdict, seconds, limit,
estimate), current (the stage running now: name and start time), env.txt (preflight's output),
logs/<stage>.txt and json/<benchmark>.json; the script tars WORK into DIR/logs.tar.gz itself.
Both files are written through a temporary file and a rename, so a reader (or a kill) never
finds half of one.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize import summarize  # noqa: E402

# pytest's last line, e.g. "==== 3 failed, 40 passed, 2 skipped in 12.3s ===="
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
FAILURE_LINES = 12


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stages(work: Path) -> list[dict]:
    rows = []
    tsv = work / "stages.tsv"
    for line in (tsv.read_text().splitlines() if tsv.exists() else []):
        name, verdict, seconds, limit, estimate = line.split("\t")
        rows.append({"stage": name, "verdict": verdict, "seconds": int(seconds),
                     "limit_s": int(limit), "estimate_s": int(estimate)})
    current = work / "current"
    if current.exists():
        name, start, limit, estimate = current.read_text().split()
        rows.append({"stage": name, "verdict": "RUNNING (or the run was stopped here)",
                     "seconds": int(time.time()) - int(start), "limit_s": int(limit),
                     "estimate_s": int(estimate)})
    return rows


def test_counts(log: str) -> dict:
    """{outcome: count} from pytest's final summary line, {} if it never printed one."""
    for line in reversed(log.splitlines()):
        if line.startswith("=") and COUNTS.search(line):
            return {k.rstrip("s") if k.startswith("error") else k: int(n)
                    for n, k in COUNTS.findall(line)}
    return {}


def failure_lines(stage: dict, log: str) -> list[str]:
    """The first lines that say what failed: pytest's FAILED/ERROR lines, else the log's tail."""
    picked = [ln for ln in log.splitlines()
              if re.match(r"(FAILED|ERROR) |preflight: (MISSING|WARNING)", ln)]
    if not picked and not stage["verdict"].startswith("ok"):
        picked = [ln for ln in log.splitlines() if ln.strip()][-FAILURE_LINES:]
    return picked[:FAILURE_LINES]


def versions(work: Path) -> dict:
    env = work / "env.txt"
    out = {}
    for line in (env.read_text().splitlines() if env.exists() else []):
        m = re.match(r"(python|torch|triton|transformers|gpu|cuda|nvcc) (.+)", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2)
    return out


def benchmarks(work: Path) -> dict:
    out = {}
    for path in sorted((work / "json").glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as e:     # a kill during the very first write
            out[path.stem] = {"error": f"unreadable: {e}"}
    return out


def main(work: Path, out: Path, mode: str) -> None:
    rows = stages(work)
    logs = {r["stage"]: (work / "logs" / f"{r['stage']}.txt") for r in rows}
    logs = {k: p.read_text(errors="replace") if p.exists() else "" for k, p in logs.items()}
    tests = {r["stage"]: test_counts(logs[r["stage"]]) for r in rows if test_counts(logs[r["stage"]])}
    failed = [r for r in rows if not r["verdict"].startswith(("ok", "skipped", "not run"))]
    result = {"mode": mode, "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "verdict": "FAILED" if failed else "ok", "versions": versions(work), "stages": rows,
              "tests": tests, "benchmarks": benchmarks(work)}
    _write(out / "results.json", json.dumps(result, indent=1))

    v = result["versions"]
    tools = ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "triton", "transformers") if k in v)
    verdict = "every stage passed" if not failed else f"{len(failed)} stage(s) not ok"
    md = [f"# gpu_check ({mode}): {verdict}", "", f"{v.get('gpu', 'no GPU')}; {tools}", "",
          "| stage | verdict | seconds | limit | estimate | tests |", "|---|---|---|---|---|---|"]
    for r in rows:
        counts = ", ".join(f"{n} {k}" for k, n in tests.get(r["stage"], {}).items())
        md.append(f"| {r['stage']} | {r['verdict']} | {r['seconds']} | {r['limit_s']} | "
                  f"{r['estimate_s']} | {counts} |")
    for r in rows:
        lines = failure_lines(r, logs[r["stage"]])
        if lines:
            md += ["", f"## {r['stage']}: {r['verdict']}", "", "```", *lines, "```"]
    md += ["", "Every log, the benchmark JSON and the plots: logs.tar.gz. Every row: results.json.",
           "",
           summarize(work / "json") if (work / "json").is_dir() else ""]
    _write(out / "summary.md", "\n".join(md) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else "gpu")
