"""`FusedDecoder`: the decoder stack of a Llama-shaped model on CPU in one C++ call
(csrc/cpu/fused_decoder.cpp), fp32 or bf16.

Per layer it runs what the fused forward's Python loop (runner/fused/forward.py) runs, through
the same kernels with the same arguments in the same order: `rms_norm` (with the residual add),
the packed qkv `PackedLinear`, `rope_write_kv_`, `paged_attention`, the packed output projection,
`rms_norm`, the packed gate/up projection, `silu_mul`, the packed down projection; then the final
norm. So its rows are that loop's bit for bit (tests/runner/test_fused_forward.py), without the
loop's per-call cost: nine Python wrappers, pybind11 calls and output allocations a layer.
`ref_fused_decoder` (ops/reference.py) runs the same steps through the pure-torch references.

    dec = FusedDecoder(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                       eps=1e-5, scale=0.125, dtype=torch.bfloat16)
    layers = dec.layer_table([(in_norm_w, post_norm_w, qkv, o, gate_up, down, window), ...],
                             k_caches, v_caches)   # PackedLinear for qkv, o, gate_up, down
    rows = dec(x, cos, sin, layers, final_norm_w, slot_mapping, block_tables, seq_lens,
               cu_seqlens_q, k_caches[0], v_caches[0])
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, sync_threads
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.paged_attention import check_args, check_values
from cb_kernels.ops import workspace


class FusedDecoder:
    """The stack's shapes; call it with a step's tensors and a `layer_table` of the weights."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"FusedDecoder runs float32 or bfloat16, got {dtype}")
        for name, v in (("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("intermediate", intermediate)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if heads % kv_heads or head_dim % 2:
            raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) and "
                             f"head_dim ({head_dim}) even")
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.intermediate, self.eps, self.scale, self.dtype = intermediate, eps, scale, dtype
        self.q_n, self.kv_n = heads * head_dim, kv_heads * head_dim
        self.shapes = {"qkv": (self.q_n + 2 * self.kv_n, hidden), "o": (hidden, self.q_n),
                       "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}

    def layer_table(self, layers: list, k_caches: list, v_caches: list) -> list:
        """The flat per-layer pointer table the kernel reads, checked: layers[i] = (in_norm
        weight, post_norm weight, qkv, o, gate_up, down, sliding window or None), the four
        projections PackedLinear of this dtype and shape. The table holds addresses: rebuild it
        when a weight or a cache is replaced."""
        if len(layers) != len(k_caches) or len(layers) != len(v_caches) or not layers:
            raise ValueError(f"need one k and v cache per layer: {len(layers)} layers, "
                             f"{len(k_caches)} k caches, {len(v_caches)} v caches")
        table = []
        for i, (in_w, post_w, *lins, window) in enumerate(layers):
            for name, w in (("in_norm", in_w), ("post_norm", post_w)):
                self._check_norm(f"layer {i} {name}", w)
            for name, lin in zip(("qkv", "o", "gate_up", "down"), lins):
                if not isinstance(lin, PackedLinear) or lin.dtype != self.dtype or \
                        (lin.n, lin.k) != self.shapes[name]:
                    raise ValueError(f"layer {i} {name} must be a {self.dtype} PackedLinear of "
                                     f"[n, k] = {list(self.shapes[name])}")
            for name, c in (("k_cache", k_caches[i]), ("v_cache", v_caches[i])):
                if c.dtype != self.dtype or c.dim() != 4 or c.shape[2:] != (self.kv_heads,
                                                                            self.head_dim) \
                        or c.stride() != k_caches[0].stride() or c.shape != k_caches[0].shape:
                    raise ValueError(f"layer {i} {name} must be [num_blocks, block_size, "
                                     f"{self.kv_heads}, {self.head_dim}] {self.dtype} with layer "
                                     "0's shape and strides")
            table += [in_w.data_ptr(), post_w.data_ptr()]
            table += [lin.packed.data_ptr() for lin in lins]
            table += [0 if lin.bias is None else lin.bias.data_ptr() for lin in lins]
            table += [k_caches[i].data_ptr(), v_caches[i].data_ptr(), int(window or 0)]
        return table

    def _check_norm(self, name: str, w) -> None:
        if not isinstance(w, torch.Tensor) or w.dtype != self.dtype or \
                tuple(w.shape) != (self.hidden,) or not w.is_contiguous() or w.device.type != "cpu":
            raise ValueError(f"{name} weight must be a contiguous {self.dtype} CPU [{self.hidden}]")

    def workspace_bytes(self, num_tokens: int) -> int:
        """Scratch bytes (ops/workspace.py) of a call over num_tokens tokens."""
        return workspace.parts_bytes(_scratch_sizes(
            num_tokens, self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim,
            self.intermediate, self.dtype))

    def __call__(self, x, cos, sin, table: list, final_norm, slot_mapping, block_tables, seq_lens,
                 cu_seqlens_q, k_cache, v_cache) -> torch.Tensor:
        """x: the embeddings [tokens, hidden] (contiguous; left holding the residual stream);
        cos, sin: [tokens, head_dim]; table: `layer_table`'s; final_norm: [hidden];
        slot_mapping: int64 [tokens]; block_tables, seq_lens, cu_seqlens_q: as
        `paged_attention` takes them; k_cache, v_cache: layer 0's (for the checks; every layer's
        has their shape). Returns final_norm's rows [tokens, hidden]."""
        t = x.shape[0] if x.dim() == 2 else -1
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.hidden \
                or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous {self.dtype} [tokens, {self.hidden}]")
        self._check_norm("final_norm", final_norm)
        for name, c in (("cos", cos), ("sin", sin)):
            if c.dtype != self.dtype or tuple(c.shape) != (t, self.head_dim) or not c.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {self.dtype} [{t}, {self.head_dim}]")
        if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (t,):
            raise ValueError(f"slot_mapping must be int64 [{t}]")
        q = torch.empty(t, self.heads, self.head_dim, dtype=self.dtype)     # its shape, for the checks
        check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, self.scale, None,
                   None, None)
        check_values(t, k_cache, block_tables, seq_lens, cu_seqlens_q)
        if len(table) % 13 or len(table) == 0:
            raise ValueError("table must come from layer_table")
        args = (x, cos, sin, table, final_norm, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                k_cache, v_cache, self.hidden, self.heads, self.kv_heads, self.head_dim,
                self.intermediate, self.eps, self.scale)
        # Eager calls skip the dispatcher's layers (see ops/paged_attention/__init__.py for what
        # they cost); torch.compile must see the registered op to trace it.
        if torch.compiler.is_compiling():
            return torch.ops.cb_kernels.fused_decoder(*args)
        return _run(*args)


def _scratch_sizes(t: int, hidden: int, q_n: int, kv_n: int, intermediate: int, dtype) -> list:
    """Bytes of the stack's buffers h, qkv, attn, sub, gate_up, act over t tokens."""
    es = torch.finfo(dtype).bits // 8
    widths = (hidden, q_n + 2 * kv_n, q_n, hidden, 2 * intermediate, intermediate)
    return [t * w * es for w in widths]


def _run(x, cos, sin, table, final_norm, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
         k_cache, v_cache, hidden, heads, kv_heads, head_dim, intermediate, eps, scale):
    """The C++ stack on checked arguments (`FusedDecoder.__call__`'s, then its shapes)."""
    t, dtype = x.shape[0], x.dtype
    q_n, kv_n = heads * head_dim, kv_heads * head_dim

    out = torch.empty(t, hidden, dtype=dtype)
    # The stack's per-layer buffers: this thread's workspace (ops/workspace.py), not six fresh
    # tensors a call (multi-MB in a prefill: fresh mmaps whose pages fault on first write).
    h, qkv, attn, sub, gate_up, act = workspace.scratch_parts(
        _scratch_sizes(t, hidden, q_n, kv_n, intermediate, dtype))
    p = _C.FusedDecoderParams()
    p.dtype, p.tokens, p.hidden, p.heads, p.kv_heads = DTYPE_CODES[dtype], t, hidden, heads, kv_heads
    p.head_dim, p.intermediate, p.eps, p.scale = head_dim, intermediate, eps, scale
    p.x, p.out, p.final_norm = x.data_ptr(), out.data_ptr(), final_norm.data_ptr()
    p.h, p.qkv, p.attn, p.sub = h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), sub.data_ptr()
    p.gate_up, p.act, p.cos, p.sin = gate_up.data_ptr(), act.data_ptr(), cos.data_ptr(), \
        sin.data_ptr()
    p.slot_mapping, p.block_tables = slot_mapping.data_ptr(), block_tables.data_ptr()
    p.seq_lens, p.cu_seqlens_q = seq_lens.data_ptr(), cu_seqlens_q.data_ptr()
    p.num_seqs, p.max_blocks_per_seq = block_tables.shape
    p.block_table_stride = block_tables.stride(0)
    p.num_blocks, p.block_size = k_cache.shape[0], k_cache.shape[1]
    p.k_stride, p.v_stride = k_cache.stride()[:3], v_cache.stride()[:3]
    sync_threads()
    _C.fused_decoder(p, table)
    return out


# The caches of layers after the first are written through the table's addresses, which the
# schema cannot name: the op declares x and layer 0's caches.
@torch.library.custom_op("cb_kernels::fused_decoder", mutates_args=("x", "k_cache", "v_cache"))
def _fused_decoder_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: list[int],
                      final_norm: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                      eps: float, scale: float) -> torch.Tensor:
    return _run(x, cos, sin, table, final_norm, slot_mapping, block_tables, seq_lens,
                cu_seqlens_q, k_cache, v_cache, hidden, heads, kv_heads, head_dim, intermediate,
                eps, scale)


@_fused_decoder_op.register_fake
def _(x, cos, sin, table, final_norm, slot_mapping, block_tables, seq_lens, cu_seqlens_q,
      k_cache, v_cache, hidden, heads, kv_heads, head_dim, intermediate, eps, scale):
    return x.new_empty(x.shape[0], hidden)
