"""One stateful layer's decode step on our kernels, timed op by op against its glue in torch.

    python bench/bench_hybrid_layer.py [--shapes qwen3-next-hd128,mamba2-ds128]
        [--dtypes bfloat16,float32] [--threads 1,2] [--rows 16] [--iters 300] [--json out.json]

Per shape, dtype and thread count, one layer of bench_hybrid.py's model (linears packed as the
engine packs them) decodes `rows` sequences from their slots, medians of `iters` calls,
interleaved: "layer" is runner/hybrid_kernels.py's forward (the engine's path); "torch glue" is
the same kernels with transformers' own split (fix_query_key_value_ordering + cat) and gated
norm module around them, what the forward ran before ops.gated_rms_norm; "kernels" is the
conv + scan calls alone (the floor the glue adds to). Ratios are within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid import build  # noqa: E402

from cb_kernels import ops  # noqa: E402
from cb_kernels.runner.hybrid_kernels import (GatedDeltaNetKernels, Mamba2Kernels,  # noqa: E402
                                              VarlenRows)
from cb_kernels.runner.packed_linears import PackedLinears  # noqa: E402
from cb_kernels.runner.state_cache import _Group  # noqa: E402


def gdn_torch_glue(k, x, rows):
    """GatedDeltaNetKernels before the fused norm: transformers' split and RMSNormGated."""
    m, n = k.module, x.shape[1]
    q, kk, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    mixed = torch.cat((q.reshape(n, -1), kk.reshape(n, -1), v.reshape(n, -1)), dim=-1)
    conv = ops.causal_conv1d_unchecked(mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias,
                                       k.conv_state, rows.slots, rows.cu_seqlens, rows.has_state,
                                       "silu")
    q = conv[:, :m.key_dim].view(n, m.num_k_heads, m.head_k_dim)
    kk = conv[:, m.key_dim:2 * m.key_dim].view(n, m.num_k_heads, m.head_k_dim)
    v = conv[:, 2 * m.key_dim:].view(n, m.num_v_heads, m.head_v_dim)
    beta = b.reshape(n, -1).sigmoid().float().contiguous()
    g = (-m.A_log.float().exp() * F.softplus(a.reshape(n, -1).float() + m.dt_bias)).contiguous()
    core = torch.empty((n, m.num_v_heads, m.head_v_dim), dtype=v.dtype)
    ops.gated_delta_rule_unchecked(q, kk, v, g, beta, k.state, rows.slots, rows.cu_seqlens,
                                   rows.has_state, core, k.scale)
    core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(core.reshape(1, n, -1))


def mamba_torch_glue(k, x, rows):
    """Mamba2Kernels before the fused norm: transformers' MambaRMSNormGated."""
    m, n = k.module, x.shape[1]
    gate, xbc, dt = m.in_proj(x)[0].split([m.intermediate_size, m.conv_dim, m.num_heads], -1)
    conv = ops.causal_conv1d_unchecked(xbc, m.conv1d.weight.squeeze(1), m.conv1d.bias,
                                       k.conv_state, rows.slots, rows.cu_seqlens, rows.has_state,
                                       "silu")
    bc = m.n_groups * m.ssm_state_size
    y = ops.selective_scan(conv[:, :m.intermediate_size].view(n, m.num_heads, m.head_dim),
                           dt.float().contiguous(), -torch.exp(m.A_log.float()),
                           conv[:, m.intermediate_size:m.intermediate_size + bc].view(n, m.n_groups, -1),
                           conv[:, m.intermediate_size + bc:].view(n, m.n_groups, -1),
                           k.state, rows.slots, rows.cu_seqlens, rows.has_state,
                           D=m.D.float(), dt_bias=m.dt_bias.float())
    y = m.norm(y.view(1, n, -1), gate[None])
    return m.out_proj(y.to(x.dtype))


def kernels_only(k, mixed, rows, extra):
    m = k.module
    ops.causal_conv1d_unchecked(mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias, k.conv_state,
                                rows.slots, rows.cu_seqlens, rows.has_state, "silu")
    extra()


def measure(shape, dtype, threads, rows_n, iters) -> dict:
    torch.set_num_threads(threads)
    model = build(shape).to(dtype)
    m = next(x for x in model.modules()
             if type(x).__name__ in ("Qwen3NextGatedDeltaNet", "Mamba2Mixer"))
    gdn = type(m).__name__ == "Qwen3NextGatedDeltaNet"
    kind = GatedDeltaNetKernels if gdn else Mamba2Kernels
    gen = torch.Generator().manual_seed(0)
    entry = {("conv", 0): torch.randn(rows_n, m.conv_dim, m.conv1d.weight.shape[-1],
                                      generator=gen).to(dtype),
             ("recurrent", 0): torch.randn(rows_n, *kind.state_shape(m), generator=gen) * 0.1}
    k = kind(m, entry)
    rows = VarlenRows([_Group(torch.arange(rows_n), torch.arange(rows_n), True)])
    x = torch.randn(1, rows_n, m.hidden_size, generator=gen).to(dtype)
    mixed = torch.randn(rows_n, m.conv_dim, generator=gen).to(dtype)
    if gdn:
        n, hv = rows_n, m.head_v_dim
        q = torch.randn(n, m.num_k_heads, m.head_k_dim, generator=gen).to(dtype)
        v = torch.randn(n, m.num_v_heads, hv, generator=gen).to(dtype)
        g = -torch.rand(n, m.num_v_heads, generator=gen)
        beta = torch.rand(n, m.num_v_heads, generator=gen)
        out = torch.empty(n, m.num_v_heads, hv, dtype=dtype)

        def scan():
            ops.gated_delta_rule_unchecked(q, q, v, g, beta, k.state, rows.slots,
                                           rows.cu_seqlens, rows.has_state, out, k.scale)
        glue = gdn_torch_glue
    else:
        n = rows_n
        xs = torch.randn(n, m.num_heads, m.head_dim, generator=gen).to(dtype)
        dt = torch.rand(n, m.num_heads, generator=gen)
        A = -torch.rand(m.num_heads, generator=gen)
        B = torch.randn(n, m.n_groups, m.ssm_state_size, generator=gen).to(dtype)

        def scan():
            ops.selective_scan(xs, dt, A, B, B, k.state, rows.slots, rows.cu_seqlens,
                               rows.has_state)
        glue = mamba_torch_glue
    contenders = {"layer": lambda: k(x, rows), "torch glue": lambda: glue(k, x, rows),
                  "kernels": lambda: kernels_only(k, mixed, rows, scan)}
    times = {name: [] for name in contenders}
    packed = PackedLinears.build(model)
    with torch.inference_mode(), packed:
        for fn in contenders.values():
            for _ in range(20):
                fn()
        for _ in range(iters):
            for name, fn in contenders.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-next-hd128,mamba2-ds128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    results = []
    print(f"load average at start: {os.getloadavg()}")
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            for threads in (int(t) for t in a.threads.split(",")):
                r = measure(shape, getattr(torch, dtype), threads, a.rows, a.iters)
                results.append(dict(shape=shape, dtype=dtype, threads=threads, rows=a.rows,
                                    us=r))
                print(f"{shape:18s} {dtype:9s} {threads} thr: layer {r['layer']:7.1f} us, torch "
                      f"glue {r['torch glue']:7.1f} us ({r['torch glue'] / r['layer']:.2f}x), "
                      f"kernels {r['kernels']:7.1f} us ({r['kernels'] / r['layer']:.0%} of "
                      "the layer)")
    print(f"load average at end: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
