"""Where an engine step's time goes on CPU, op by op, against each op's floor.

    python bench/profile_step.py --model smollm2-135m --dtype bfloat16 --rows 16,64 --threads 2
    python bench/profile_step.py --model llama-1b --dtype bfloat16 --rows 16,64 --json out.json
    python bench/profile_step.py --dtype float32 --rows 512 --n 8 --prompt-len 38 --temperature 1 \
        --decode-steps 28

For each row count it builds an Engine, runs that many requests (64-token random prompts) into
steady decode (with --n N: rows / N prompts of --prompt-len tokens, N samples each, whose rows
share the prompt's full blocks as a GRPO round's do; --temperature samples instead of greedy;
--decode-steps K runs K more decode steps first, for longer contexts), takes one decode step's inputs and one prefill chunk's (a fresh 512-token
prompt), and times, best of --repeats:
  step          engine.step() as the user's loop runs it (decode steps in flight; median)
  execute       the runner's step on the captured inputs: decoder + greedy head
  decoder       the one-call FusedDecoder (ops.FusedDecoder) alone, or the Python loop
  per op        the decoder's ops one by one through the same kernels (the fused forward's loop,
                runner/fused/forward.py, with a clock around each call; each call carries
                ~5-10 us of Python): norms, rotary + K/V write, attention, the four linears,
                SiLU * up; then the greedy head, the full logits head + argmax, and the sampler
                (temperature 1) on those logits
Python and framework overhead = step - execute (scheduling, input packing, token bookkeeping)
and loop sum - decoder (what one C++ call saves).

Floors: a decode op's bytes (weights; K/V for attention) over the copy bandwidth measured in
this run (a 512 MiB tensor copy, read + write bytes), and a decode linear's FLOPs over the GEMM
rate below (its multiply floor: at 16 rows of the 1B shape the two are close, so a step cannot
reach its read floor unless reads and multiplies overlap fully); a prefill op's FLOPs over the
best bf16 (or fp32) GEMM rate measured in this run (oneDNN and ours at 512 x 2048 x 2048, weight
in cache). Also printed: the nominal AVX512-BF16 peak, one 512-bit vdpbf16ps (64 FLOP) per cycle
per core at /proc/cpuinfo's clock, an assumption labelled so; on the Zen 4 VM /proc gives the
base clock (2596 MHz) while a register-only vdpbf16ps loop runs 3.6 G a second a core, so the
measured GEMM rate is the floor used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
import cb_kernels  # noqa: E402,F401  (before torch: the OpenMP spin setting)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import cpu_features, load_model, versions  # noqa: E402
from profile_ops import OpClock, loop_step  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def best(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_gbps(repeats: int = 5) -> float:
    src = torch.empty(512 * 2**20 // 4).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best(lambda: dst.copy_(src), repeats) / 1e9


def gemm_peak(dtype) -> dict:
    """FLOP/s of the best GEMM this CPU runs at 512 x 2048 x 2048 (weight in cache)."""
    from cb_kernels.ops import PackedLinear

    x = torch.randn(512, 2048).to(dtype)
    w = torch.randn(2048, 2048).to(dtype) * 0.02
    flop = 2 * 512 * 2048 * 2048
    lin = PackedLinear(w)
    out = {"ours": flop / best(lambda: lin.run_unchecked(x), 5)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)
        out["onednn"] = flop / best(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 5)
    mhz = 0.0
    try:
        with open("/proc/cpuinfo") as f:
            mhz = next(float(line.split(":")[1]) for line in f if line.startswith("cpu MHz"))
    except (OSError, StopIteration, ValueError):
        pass
    out["nominal_bf16"] = mhz * 1e6 * 64 * torch.get_num_threads()
    return out


def capture(engine):
    """Wrap the runner's execute: the last call's inputs and each call's seconds."""
    runner = engine.runner
    seen = {"inputs": None, "times": []}
    inner = runner.execute

    def execute(inputs, greedy=False):
        t0 = time.perf_counter()
        out = inner(inputs, greedy)
        seen["times"].append(time.perf_counter() - t0)
        seen["inputs"] = inputs
        return out
    runner.execute = execute
    return seen, inner


def profile_inputs(engine, inner, inputs, repeats: int, bw: float, peak: float, kind: str):
    """The per-op table of one captured step (re-running it writes the same K/V slots)."""
    runner = engine.runner
    fused, head = runner.fused, runner.head
    attn = inputs.attn
    args = (inputs.input_ids, inputs.positions, inputs.logits_indices, attn)
    res = {"tokens": int(inputs.input_ids.shape[0]), "seqs": int(inputs.num_seqs),
           "native": fused.native is not None}
    res["execute_ms"] = 1e3 * best(lambda: inner(inputs, True), repeats)
    res["decoder_ms"] = 1e3 * best(lambda: fused(*args), repeats)
    clock = OpClock()
    for _ in range(2):
        loop_step(fused, *args, clock=OpClock())
    sums = []
    for _ in range(repeats):
        c = OpClock()
        t0 = time.perf_counter()
        rows = loop_step(fused, *args, clock=c)
        sums.append((time.perf_counter() - t0, c))
    total, clock = min(sums, key=lambda s: s[0])
    res["loop_ms"] = 1e3 * total
    ops_ms = {k: 1e3 * v for k, v in clock.seconds.items()}
    ops_ms["greedy_head"] = 1e3 * best(lambda: head.tokens(rows), repeats)
    logits = head.logits(rows)
    ops_ms["logits_head"] = 1e3 * best(lambda: head.logits(rows), repeats)
    ops_ms["argmax"] = 1e3 * best(lambda: logits.argmax(-1), repeats)
    gen = torch.Generator().manual_seed(0)
    ops_ms["sample_t1"] = 1e3 * best(
        lambda: torch.multinomial(torch.softmax(logits, -1), 1, generator=gen), repeats)
    res["ops_ms"] = ops_ms
    res["floors_ms"] = floors(fused, head, inputs, bw, peak, kind)
    if kind == "decode":    # a decode linear's FLOPs at the GEMM peak: the multiply floor
        res["multiply_floors_ms"] = floors(fused, head, inputs, bw, peak, "multiply")
    return res


def floors(fused, head, inputs, bw: float, peak: float, kind: str) -> dict:
    """Each op's floor in ms: decode, its bytes over `bw`; prefill, its FLOPs over `peak`;
    "multiply", the four linears' FLOPs over `peak` (a decode step's other floor)."""
    t = int(inputs.input_ids.shape[0])
    layers = fused.layers
    es = layers[0].qkv.lin.packed.element_size() if layers[0].qkv.lin is not None else 2
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n_k = sum(getattr(layer, name).lin.n * getattr(layer, name).lin.k for layer in layers)
        out[name] = 1e3 * (n_k * es / bw if kind == "decode" else 2 * t * n_k / peak)
    if kind == "multiply":
        return out
    l0 = layers[0]
    seq_lens = inputs.attn.seq_lens.tolist()
    q_lens = torch.diff(inputs.attn.cu_seqlens_q).tolist()
    kv_row = l0.num_kv_heads * l0.head_dim * es * 2       # K and V of one token
    if kind == "decode":    # a block shared by several rows (n samples) is read once
        out["attention"] = 1e3 * len(layers) * kv_tokens(inputs.attn) * kv_row / bw
    else:       # causal: each query row sees its prefix
        pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens))
        out["attention"] = 1e3 * len(layers) * 4 * pairs * l0.num_heads * l0.head_dim / peak
    vocab, hidden = head.module.weight.shape
    g = getattr(head, "greedy", None)
    out["greedy_head"] = 1e3 * (g.packed.numel() if g is not None else vocab * hidden * es) / bw
    out["logits_head"] = 1e3 * vocab * hidden * es / bw
    return out


def kv_tokens(attn) -> int:
    """K/V tokens a step reads, each block once: the distinct blocks of the rows' tables (full
    blocks; the last block of a row counted whole)."""
    bs = next(k for k in attn.layout.k_caches if k is not None).shape[1]
    lens = attn.seq_lens.tolist()
    tables = attn.block_tables.tolist()
    used = {b for row, n in zip(tables, lens) for b in row[:-(-n // bs)]}
    return len(used) * bs


def shared_rows(attn) -> int:
    """Rows whose table begins with the block of the row before (a shared-prefix group's)."""
    t = attn.block_tables
    return int((t[1:, 0] == t[:-1, 0]).sum()) if t.shape[0] > 1 else 0


def run_rows(model, num_rows: int, repeats: int, bw: float, peak: float, n: int = 1,
             prompt_len: int = 64, temperature: float = 0.0, decode_steps: int = 0) -> dict:
    from cb_kernels import Engine, EngineConfig, SamplingParams

    engine = Engine(model, EngineConfig(cpu_offload_gib=0, max_num_seqs=max(num_rows, 16)))
    if engine.runner.fused is None:
        raise SystemExit("this model does not run the fused CPU forward here: nothing to profile")
    seen, inner = capture(engine)
    gen = torch.Generator().manual_seed(num_rows)
    vocab = model.config.vocab_size
    params = SamplingParams(max_new_tokens=1000, ignore_eos=True, n=n, temperature=temperature,
                            seed=0 if temperature > 0 else None)
    rids = [engine.add_request(torch.randint(1, vocab, (prompt_len,), generator=gen).tolist(),
                               params)
            for _ in range(num_rows // n)]
    while seen["inputs"] is None or not seen["inputs"].is_decode or \
            seen["inputs"].num_seqs != num_rows:
        engine.step()
    for _ in range(decode_steps):     # deeper into the decode: longer contexts
        engine.step()
    step_times = []
    for _ in range(max(repeats, 8)):
        seen["times"].clear()
        t0 = time.perf_counter()
        engine.step()
        step_times.append((time.perf_counter() - t0, sum(seen["times"])))
    decode = profile_inputs(engine, inner, seen["inputs"], repeats, bw, peak, "decode")
    decode["shared_rows"] = shared_rows(seen["inputs"].attn)
    decode["step_ms"] = 1e3 * statistics.median(s for s, _ in step_times)
    decode["step_execute_ms"] = 1e3 * statistics.median(e for _, e in step_times)
    for rid in rids:
        engine.cancel(rid)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(torch.randint(1, vocab, (512,), generator=gen).tolist(),
                       SamplingParams(max_new_tokens=1))
    seen["inputs"] = None
    engine.step()
    prefill = profile_inputs(engine, inner, seen["inputs"], max(2, repeats // 2), bw, peak,
                             "prefill")
    return {"rows": num_rows, "decode": decode, "prefill": prefill}


def report(name: str, r: dict) -> None:
    ops_ms, fl = r["ops_ms"], r["floors_ms"]
    print(f"  {name}: {r['tokens']} tokens in {r['seqs']} seqs; execute {r['execute_ms']:.2f} ms"
          f" = decoder {r['decoder_ms']:.2f} ({'one call' if r['native'] else 'loop'}) + head; "
          f"op loop {r['loop_ms']:.2f} ms" + (f"; engine step {r['step_ms']:.2f} ms (runner "
                                               f"{r['step_execute_ms']:.2f})" if "step_ms" in r else "")
          + (f"; {r['shared_rows']} rows share their first block with the row before"
             if r.get("shared_rows") else ""))
    mul = r.get("multiply_floors_ms", {})
    for op, ms in ops_ms.items():
        floor = fl.get(op)
        print(f"    {op:>14}: {ms:8.3f} ms" + (f"   floor {floor:8.3f} ms   x{ms / floor:5.2f}"
                                                 if floor else "")
              + (f"   multiply {mul[op]:8.3f} ms   x{ms / mul[op]:5.2f}" if op in mul else ""))
    if mul:
        read = sum(fl[k] for k in ("qkv", "o", "gate_up", "down", "attention", "greedy_head"))
        both = sum(max(fl[k], mul.get(k, 0.0))
                   for k in ("qkv", "o", "gate_up", "down", "attention", "greedy_head"))
        print(f"    step floors: read {read:.2f} ms (execute x{r['execute_ms'] / read:.2f}); "
              f"the larger of read and multiply per op {both:.2f} ms "
              f"(x{r['execute_ms'] / both:.2f}); linears' multiply {sum(mul.values()):.2f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2-135m", "llama-1b"), default="smollm2-135m")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--rows", default="16,64", help="decode batch sizes, comma list")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--n", type=int, default=1, help="samples a prompt (rows / n prompts)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="decode steps run before the measured ones (longer contexts)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.repeats < 1:
        p.error("--rows must list positive ints and --repeats be >= 1")
    if args.n < 1 or any(r % args.n for r in rows) or args.prompt_len < 1 or args.temperature < 0 \
            or args.decode_steps < 0:
        p.error("--n must be >= 1 and divide every --rows entry, --prompt-len >= 1, "
                "--temperature >= 0, --decode-steps >= 0")
    dtype = DTYPES[args.dtype]
    model, _, _ = load_model(args.model, dtype)
    bw = copy_gbps() * 1e9
    peaks = gemm_peak(dtype)
    peak = max(v for k, v in peaks.items() if k != "nominal_bf16")
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, load "
          f"{os.getloadavg()[0]:.1f}; copy {bw / 1e9:.1f} GB/s; GEMM peak measured "
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in peaks.items()) + " TFLOP/s")
    res = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
           "n": args.n, "prompt_len": args.prompt_len, "temperature": args.temperature,
           "decode_steps": args.decode_steps,
           "versions": versions(), "cpu_features": cpu_features(), "copy_gbps": bw / 1e9,
           "gemm_flops": peaks, "load_before": os.getloadavg(), "results": []}
    for n in rows:
        r = run_rows(model, n, args.repeats, bw, peak, args.n, args.prompt_len, args.temperature,
                     args.decode_steps)
        print(f"{n} rows:")
        report("decode", r["decode"])
        report("prefill", r["prefill"])
        res["results"].append(r)
    res["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
