"""The fused CPU forward's layer loop (runner/fused/forward.py, FusedForward.__call__) with a
clock around each kernel call, for bench/profile_step.py. Same kernels, same arguments, same
order; only the timing is added (so each op's time carries its Python call, ~5-10 us)."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from cb_kernels import ops


class OpClock:
    """Seconds per op name, summed over the layers of one step."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def __call__(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds[name] += time.perf_counter() - t0
        return out


@torch.inference_mode()
def loop_step(fused, input_ids, positions, logits_indices, step, clock: OpClock) -> torch.Tensor:
    """FusedForward.__call__'s Python loop, timed per op; returns the final-norm rows."""
    d = fused.decoder
    x = clock("embed", d.embed_tokens, input_ids[None])
    cos, sin = clock("rotary", fused.rotary, x, positions)
    x = x[0].contiguous()
    num_tokens = x.shape[0]
    pending = None
    for i, layer in enumerate(fused.layers):
        h = clock("norms", layer.in_norm.fused, x, pending)
        q, k, v = clock("qkv", layer.qkv.run, h).split(layer.splits, dim=-1)
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        k_cache, v_cache = step.layout.k_caches[i], step.layout.v_caches[i]
        clock("rope_write_kv", ops.rope_write_kv_unchecked, q, k, v, cos, sin, k_cache, v_cache,
              step.slot_mapping, check_metadata=False)
        out = clock("attention", ops.paged_attention_unchecked, q, k_cache, v_cache,
                    step.block_tables, step.seq_lens, step.cu_seqlens_q, torch.empty_like(q),
                    scale=layer.scaling, sliding_window=layer.window, backend="cpu")
        o = clock("o", layer.o.run, out.view(num_tokens, -1))
        h = clock("norms", layer.post_norm.fused, x, o)
        act = clock("silu_mul", ops.silu_mul, clock("gate_up", layer.gate_up.run, h))
        pending = clock("down", layer.down.run, act)
    x = clock("norms", fused.final_norm.fused, x, pending)
    return x.index_select(0, logits_indices)
