"""bench/gpu_check.sh on the CPU (--rehearse): its budget, and what a stage stopped before its
end leaves in the bundle (the device returns only the files under $OUT, so what a cut-short run
proves must already be there). .ci/run rehearses the whole script besides."""
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUNDLE = {"summary.md", "results.json", "logs.tar.gz"}


def _env(work: Path) -> dict:
    return dict(os.environ, PY=sys.executable, GPU_CHECK_WORK=str(work))


def test_stage_limits_fit_the_budget_and_match_the_header():
    plan = subprocess.run(["bash", str(SCRIPT), "--plan", "--sanitize"], capture_output=True, text=True,
                          timeout=30)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    limits = {m[0]: (int(m[1]), int(m[2])) for m in
              re.findall(r"^(\w+)\s+estimate\s+(\d+) s\s+limit\s+(\d+) s$", plan.stdout, re.M)}
    default = {k: v for k, v in limits.items() if k != "sanitizer"}
    assert sum(lim for _, lim in default.values()) <= 420
    assert f"total of the default stages' limits: {sum(l for _, l in default.values())} s" in plan.stdout
    # The header's table says the same estimates and limits as the code.
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    table = {m[0]: (int(m[1]), int(m[2])) for m in
             re.findall(r"^#   (\w+) .*?(\d+) s / +(\d+) s$", header, re.M)}
    assert table.pop("total") == (sum(e for e, _ in default.values()), sum(l for _, l in default.values()))
    assert table == limits


def test_benchmark_stopped_mid_run_keeps_its_finished_rows(tmp_path):
    """The engine stage is stopped (SIGTERM to the script, as a lease's end would) once its first
    contender's row is written and while the later ones run: the bundle holds that row, the
    stage's state and its log."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--rehearse", "--only", "engine", str(out)],
                            env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    partial = work / "json" / "engine.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if partial.exists() and "cb_kernels" in json.loads(partial.read_text())["results"]:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the engine stage ended before it could be stopped:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, log
    assert {p.name for p in out.iterdir()} == BUNDLE
    results = json.loads((out / "results.json").read_text())
    rows = results["benchmarks"]["engine"]["rows"]
    assert [r["contender"] for r in rows][:1] == ["cb_kernels"] and rows[0]["tok_per_s"] > 0
    assert results["stages"][-1]["stage"] == "engine"
    assert results["stages"][-1]["verdict"].startswith("RUNNING")
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./logs/engine.txt" in tar.getnames()


def test_stage_over_its_limit_is_reported_timed_out(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(["bash", str(SCRIPT), "--rehearse", "--only", "engine", "--limit", "engine=4",
                        str(out)], env=_env(work), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert {p.name for p in out.iterdir()} == BUNDLE
    results = json.loads((out / "results.json").read_text())
    assert [(s["stage"], s["limit_s"]) for s in results["stages"]] == [("engine", 4)]
    assert results["stages"][0]["verdict"].startswith("TIMED OUT")
    summary = (out / "summary.md").read_text()
    assert "| engine | TIMED OUT at 4s" in summary and "## engine: TIMED OUT" in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./logs/engine.txt" in tar.getnames()
