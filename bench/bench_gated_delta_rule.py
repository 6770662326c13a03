"""The gated delta rule alone at Qwen3-Next's real head dims, against transformers' torch
reference (what the engine ran before: torch_recurrent_gated_delta_rule for a decode batch,
torch_chunk_gated_delta_rule per prefill row) and the copy ceiling (reading and writing the rows'
state slots once between preallocated buffers: a decode cannot move less; for a prefill the
compute dominates and the ratio is not a ceiling), interleaved in one run.

    python bench/bench_gated_delta_rule.py [--dtype bf16|fp32] [--threads 1] [--repeats 20]
        [--device cpu|cuda] [--json out.json]

Shapes: Qwen3-Next-80B's linear attention per layer: 16 key heads, 32 value heads, k_dim =
v_dim = 128 (state 2 MiB a sequence). decode: 16 rows of 1 token; prefill: 4 rows of 128
tokens (fresh); mixed: 12 decodes + 2 prefills of 64 tokens. On --device cuda (the GPU stage)
it first checks the Triton kernel against ops/reference.py on every shape (raises on a
mismatch), then times it against the reference and the copy ceiling; a few seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from cb_kernels import ops  # noqa: E402
from cb_kernels.benchmarks.common import Timer, measure  # noqa: E402
from cb_kernels.ops.reference import ref_gated_delta_rule  # noqa: E402

HK, HV, D = 16, 32, 128
SHAPES = {"decode": [(1, True)] * 16, "prefill": [(128, False)] * 4,
          "mixed": [(1, True)] * 12 + [(64, False)] * 2}


def inputs(rows, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(r for r, _ in rows)
    q = torch.randn(n, HK, D, generator=gen).to(dtype)
    k = torch.randn(n, HK, D, generator=gen).to(dtype)
    v = torch.randn(n, HV, D, generator=gen).to(dtype)
    g = -torch.rand(n, HV, generator=gen)
    beta = torch.rand(n, HV, generator=gen)
    state = torch.randn(len(rows) + 1, HV, D, D, generator=gen) * 0.1
    slots = torch.arange(len(rows), dtype=torch.int64)
    cu = torch.tensor([0] + [r for r, _ in rows]).cumsum(0).to(torch.int32)
    has = torch.tensor([c for _, c in rows], dtype=torch.bool)
    return [t.to(device) for t in (q, k, v, g, beta, state, slots, cu, has)]


def transformers_way(args, rows):
    """What the engine ran before: the decode rows as one [B, 1] recurrent call, each prefill
    row alone through the chunked rule (the layer's own functions, on gathered slot copies)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    q, k, v, g, beta, state, slots, cu, has = args
    cu_l = cu.tolist()
    dec = [i for i, (r, c) in enumerate(rows) if r == 1 and c]
    pre = [i for i in range(len(rows)) if i not in dec]
    dec_t = torch.tensor([cu_l[i] for i in dec], dtype=torch.int64, device=q.device)
    dec_s = slots[dec] if dec else None

    def run():
        if dec:
            _, s = m.torch_recurrent_gated_delta_rule(
                q[dec_t][:, None], k[dec_t][:, None], v[dec_t][:, None], g=g[dec_t][:, None],
                beta=beta[dec_t][:, None], initial_state=state.index_select(0, dec_s),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
            state.index_copy_(0, dec_s, s)
        for i in pre:
            a, e = cu_l[i], cu_l[i + 1]
            _, s = m.torch_chunk_gated_delta_rule(
                q[None, a:e], k[None, a:e], v[None, a:e], g=g[None, a:e], beta=beta[None, a:e],
                initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
            state[slots[i]] = s[0]
    return run


def check(args, dtype):
    want_state = args[5].clone()
    want = ref_gated_delta_rule(*args[:5], want_state, *args[6:])
    got_state = args[5].clone()
    got = ops.gated_delta_rule(*args[:5], got_state, *args[6:])
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_state, want_state, rtol=2e-5, atol=2e-5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    timer = Timer(a.device)
    results = []
    print(f"gated_delta_rule, {a.dtype}, {a.device}, {torch.get_num_threads()} threads, "
          f"Hk={HK} Hv={HV} k_dim=v_dim={D}")
    print(f"{'shape':8} {'ours ms':>9} {'torch ms':>9} {'copy ms':>9} {'vs torch':>9} "
          f"{'vs copy':>8}")
    for name, rows in SHAPES.items():
        args = inputs(rows, dtype, a.device)
        if a.device == "cuda":
            check(inputs(rows, dtype, a.device, seed=1), dtype)
        q, k, v, g, beta, state, slots, cu, has = args
        out = torch.empty_like(v)
        scratch = state[:len(rows)].clone()
        fns = {
            "ours": lambda: ops.gated_delta_rule(q, k, v, g, beta, state, slots, cu, has, out=out),
            "torch": transformers_way(args, rows),
            # the rows' state read and written once (slots are 0..num_seqs-1 here)
            "copy": lambda: scratch.copy_(state[:len(rows)]),
        }
        times = measure(timer, fns, a.repeats)
        best = {kk: min(t) for kk, t in times.items()}
        row = {"shape": name, "dtype": a.dtype, "device": a.device,
               "threads": torch.get_num_threads(), **{f"{kk}_ms": best[kk] * 1e3 for kk in best},
               "vs_torch": best["torch"] / best["ours"], "vs_copy": best["copy"] / best["ours"]}
        results.append(row)
        print(f"{name:8} {row['ours_ms']:9.3f} {row['torch_ms']:9.3f} {row['copy_ms']:9.3f} "
              f"{row['vs_torch']:8.1f}x {row['vs_copy']:7.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
