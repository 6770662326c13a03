"""The kernel benchmarks ship with the package: `cb-kernels bench <op>` runs from a copy of the
installed package alone (no bench/ folder beside it, as after a wheel install), from a directory
outside the checkout, and writes its JSON. Sizes are the smallest each bench takes, so this
checks imports, arguments and outputs, not speed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE_ARGS = ["--device", "cpu", "--quick", "--repeats", "1", "--num-kv-heads", "1", "--head-dim", "16"]
BLOCK_ARGS = ["--num-layers", "1", "--bytes-per-call", str(64 << 10)]

# (bench name, its arguments, the JSON keys and row keys that other tools read)
CASES = [
    ("paged_attention", ["--device", "cpu", "--quick", "--threads", "1", "--reps", "1", "--copy-mib", "1",
                         "--no-baselines", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                         "--only", "decode b1 ctx512"],
     {"config", "rows", "dispatch_us"}, {"shape", "backend", "gbps", "copy_gbps", "of_copy"}),
    ("paged_attention", ["--device", "cpu", "--quick", "--threads", "1", "--reps", "1", "--copy-mib", "1",
                         "--no-baselines", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                         "--only", "decode b1 ctx512", "--dtype", "bf16", "--backends", "cpu"],
     {"config", "rows", "dispatch_us"}, {"shape", "backend", "x_fp32"}),
    ("write_kv", CACHE_ARGS + ["--num-tokens", "32"], {"meta", "rows"}, {"op", "gbps", "vs_memcpy", "vs_torch_ref"}),
    ("copy_blocks", CACHE_ARGS + BLOCK_ARGS, {"meta", "rows"}, {"op", "gbps", "vs_memcpy", "vs_transformers"}),
    ("swap_blocks", CACHE_ARGS + BLOCK_ARGS, {"meta", "rows"}, {"op", "gbps", "vs_memcpy", "pinned"}),
    ("greedy_head", ["--quick", "--threads", "1", "--repeats", "1"], {"threads", "results"},
     {"greedy_head_ms", "torch_ms", "speedup_vs_torch"}),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A folder holding only a copy of the imported cb_kernels package (compiled module included),
    like site-packages after `pip install cb_kernels-*.whl`."""
    import cb_kernels

    site = tmp_path_factory.mktemp("site")
    shutil.copytree(Path(cb_kernels.__file__).parent, site / "cb_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _cli(site, cwd, *args):
    """`python -m cb_kernels ...` run in cwd with only the copied package importable."""
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "cb_kernels", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _rows(data):
    return data["rows"] if "rows" in data else data["results"]


@pytest.mark.parametrize("name, args, keys, row_keys", CASES,
                         ids=[c[0] + ("-bf16" if "bf16" in c[1] else "") for c in CASES])
def test_kernel_bench_runs_from_the_installed_package(site, tmp_path, name, args, keys, row_keys):
    out = tmp_path / f"{name}.json"
    r = _cli(site, tmp_path, "bench", name, *args, "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert keys <= set(data)
    rows = _rows(data)
    assert rows, f"{name} wrote no rows"
    for row in rows:
        assert row_keys <= set(row), f"{name} row lacks {row_keys - set(row)}"


def test_cache_alias_writes_one_json_per_op(site, tmp_path):
    out = tmp_path / "cache"
    r = _cli(site, tmp_path, "bench", "cache", *CACHE_ARGS, "--json", str(out))    # common options only
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for op in ("swap_blocks", "copy_blocks", "write_kv"):
        assert json.loads((tmp_path / f"cache.{op}.json").read_text())["rows"]


def test_source_tree_entry_point_runs_the_packaged_bench(tmp_path):
    """bench/bench_<op>.py keeps working with the same flags: it calls the packaged main."""
    out = tmp_path / "write_kv.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_write_kv.py"), *CACHE_ARGS,
                        "--num-tokens", "32", "--json", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(out.read_text())["rows"][0]["op"] == "write_kv"


def test_engine_bench_without_the_source_tree_says_what_it_needs(site, tmp_path):
    r = _cli(site, tmp_path, "bench", "engine", "--quick")
    assert r.returncode != 0
    assert "source tree" in r.stderr and "ship with the package" in r.stderr


def test_unknown_packaged_bench_names_the_packaged_ones():
    from cb_kernels.benchmarks import KERNEL_BENCHES, run

    with pytest.raises(ValueError, match="paged_attention"):
        run("engine", [])
    assert "greedy_head" in KERNEL_BENCHES


def test_grpo_bench_quick_mode(tmp_path):
    """bench/bench_grpo.py --quick (tiny random Llama, 8 prompts x 4, 16 tokens, 2 rounds each):
    every contender ran every round, the engine followed each optimizer step (a new weight
    version per round), and the ratios and the weight-follow cost are in the JSON."""
    out = tmp_path / "grpo.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_grpo.py"), "--quick",
                        "--threads", "1", "--json", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert (data["meta"]["prompts"], data["meta"]["n"], data["meta"]["max_new_tokens"]) == (8, 4, 16)
    rows = {row["contender"]: row for row in data["rows"]}
    assert list(rows) == ["cb_kernels", "trl_default", "generate_batch"]
    for row in rows.values():
        assert len(row["generate_s"]) == len(row["step_s"]) == 2
        assert row["steady_round_s"] > row["steady_generate_s"] > 0
    assert rows["cb_kernels"]["weight_versions"] == [0, 1]
    assert set(data["ratios"]) == {"trl_default", "generate_batch"}
    assert all(v["round"] > 0 for v in data["ratios"].values())
    follow = rows["cb_kernels"]["weight_follow"]
    assert 0 < follow["check_weights_ms"] < follow["decode_step_16_ms"]
    assert follow["repack_after_step_ms"] > follow["check_weights_ms"]
    assert "cb_kernels vs trl_default" in r.stdout and "weight following" in r.stdout


def test_grpo_bench_one_contender_per_run_then_merge(tmp_path):
    """bench_grpo.py --contenders runs one contender (each its own locked command at the issue's
    shape); --merge joins such runs and prints the ratios; a run of other settings is refused."""
    bench = str(ROOT / "bench" / "bench_grpo.py")

    def run(*args):
        return subprocess.run([sys.executable, bench, *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    for name in ("cb_kernels", "trl_default"):
        r = run("--quick", "--threads", "1", "--no-weight-follow", "--contenders", name,
                "--json", str(tmp_path / f"{name}.json"))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        assert [row["contender"] for row in rows] == [name]
    r = run("--merge", str(tmp_path / "cb_kernels.json"), str(tmp_path / "trl_default.json"),
            "--json", str(tmp_path / "merged.json"))
    assert r.returncode == 0, r.stderr[-4000:]
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [row["contender"] for row in merged["rows"]] == ["cb_kernels", "trl_default"]
    assert merged["ratios"]["trl_default"]["round"] > 0 and "cb_kernels vs trl_default" in r.stdout
    other = json.loads((tmp_path / "trl_default.json").read_text())
    other["meta"]["n"] = 2
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = run("--merge", str(tmp_path / "cb_kernels.json"), str(tmp_path / "other.json"))
    assert r.returncode != 0 and "the runs differ in their settings" in r.stderr
    r = run("--quick", "--contenders", "cb_kernels,vllm")
    assert r.returncode != 0 and "--contenders takes names of" in r.stderr


def test_grpo_bench_profile_times_the_parts_of_a_step(tmp_path):
    """bench_grpo.py --profile: one engine round with timers around the step's parts; each part
    was called, the parts nest (LM head <= runner <= step; sample_tokens <= sampler) and the
    timers are taken off again (the JSON is written after the round)."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_grpo.py"), "--quick",
                        "--threads", "1", "--profile", "--json", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    parts = json.loads(out.read_text())["parts"]
    seconds = {k: v[0] for k, v in parts.items()}
    assert all(v[1] > 0 for v in parts.values()), parts
    assert seconds["LM head"] <= seconds["runner (decoder + LM head)"] <= seconds["step"]
    assert seconds["sampler: sample_tokens"] <= seconds["sampler"] <= seconds["step"]
    assert parts["sampler: record_logprob"][1] == 8 * 4 * 16        # one per generated token
    assert seconds["step"] <= parts["round_s"][0] and "ms a step" in r.stdout
