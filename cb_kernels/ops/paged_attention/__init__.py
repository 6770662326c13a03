"""`paged_attention`: causal varlen attention over a paged KV cache (prefill, chunked prefill and
decode mixed in one call), with GQA, sliding window, logit softcap and attention sinks.

Backends: "cpu" (C++ in csrc/cpu/paged_attention.cpp), "triton" (cb_kernels/triton), "cuda"
(csrc/cuda, launched by cuda.py), "torch" (the reference in ops/reference.py).

Argument checks: every wrong input raises ValueError/TypeError naming it. Shape, dtype, device
and stride checks are free (tensor metadata). Value checks (cu_seqlens_q monotone,
q_len <= seq_len, block ids inside the pool, seq_len covered by the block table) need the index
tensors' contents: they run for CPU tensors only, in C++ (~1 us for 64 sequences; the same checks
as numpy calls took ~60 us a call). On CUDA they are skipped: reading device values would sync
the host with the stream on every call and break CUDA graphs.
"""
from __future__ import annotations

import math
import numbers

import torch

from cb_kernels import _C
from cb_kernels.ops import _backend
from cb_kernels.ops._backend import check_tensor, dtype_code, same_device
from cb_kernels.ops.reference import ref_paged_attention

# Default backend for CUDA tensors: reasoned, not yet measured (bench/gpu_check.sh's attention
# stage times both on a GPU; set this from its numbers). Triton because (1) it is present
# wherever torch's CUDA wheels are (they depend on triton) while the "cuda" kernels exist only in
# builds made with nvcc;
# (2) it covers every head_dim/block_size the API allows; (3) its decode tile runs Q.K^T and P.V
# on tensor cores, which FlashInfer reports pays off from GQA group 4 up (Llama-3 uses 4-8), where
# the CUDA kernel's fp32 FMAs cost nearly as much time as its memory traffic (estimate for group 8,
# bf16 head_dim 128 on an H200, one 64-key chunk on one SM: 131k FMAs ~520 ns, plus shared-memory
# reads of q, against 32 KiB of K/V ~900 ns at 4.8 TB/s / 132 SMs).
DEFAULT_CUDA_BACKEND = "triton"
# CPU tensors default to "cpu", the C++ kernel: 10-74x the reference and 2-93x transformers'
# gather + SDPA on every bench row (bench/RESULTS.md); Triton runs on CPU only interpreted
# (549 ms against 0.2 ms for a 512-token decode).
SUPPORTED_BACKENDS = ("cuda", "triton", "cpu", "torch")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    out: torch.Tensor | None = None, backend: str | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's new tokens over its whole KV, read through its block table.

    Parameters
    ----------
    q : ``[num_tokens, num_heads, head_dim]`` float32, float16 or bfloat16, the new tokens of
        every sequence packed one sequence after the other.
    k_cache, v_cache : ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype; any
        strides with a unit last one (transformers' per-layer views work in place).
    block_tables : int32 ``[num_seqs, max_blocks_per_seq]``; row i lists the blocks of sequence
        i in order (only the first ceil(seq_lens[i] / block_size) entries are read).
    seq_lens : int32 ``[num_seqs]``, KV length of each sequence including its new tokens.
    cu_seqlens_q : int32 ``[num_seqs + 1]``; the q tokens of sequence i are
        ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``, its last positions, attended causally.
    scale : softmax scale, default ``head_dim ** -0.5``.
    sliding_window : W; a query at position p sees positions p-W+1 .. p.
    softcap : c; scores become ``c * tanh(scores / c)`` after scaling.
    out : optional ``[num_tokens, num_heads, head_dim]`` in q's dtype, written in place.
    backend : "cpu", "triton", "cuda", "torch" or None (fastest for the device).
    sinks : optional float32 ``[num_heads]``: attention sinks, one extra logit per q head in
        every softmax (after scale and softcap) whose value row is zero, as gpt-oss uses them.

    Returns ``out`` (a new tensor when not given). Index values (block ids, lengths) are checked
    for CPU tensors only; on CUDA that would sync the host with the device on every call.
    """
    scale_f, window, cap = check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                      scale, sliding_window, softcap, out)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # traced tensors have no values to read
        check_values(q.shape[0], k_cache, block_tables, seq_lens, cu_seqlens_q)
    name = _backend.resolve_backend(backend, q.device, SUPPORTED_BACKENDS, DEFAULT_CUDA_BACKEND,
                                    "paged_attention")
    check_sinks(sinks, q)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # Eager calls skip the dispatcher: a 1-token decode on one thread takes ~7 us through
    # run_backend and ~160 us through torch.ops.cb_kernels.paged_attention (the Python custom-op
    # layers: autograd, ADInplaceOrView, dynamo-disable), measured by bench/bench_paged_attention.py.
    # torch.compile must see the registered op to trace it, so traced calls take it.
    if compiling:
        torch.ops.cb_kernels.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             cu_seqlens_q, out, scale_f, window, cap, name, sinks)
    else:
        run_backend(name, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale_f,
                    window, cap, sinks)
    return out


def check_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, sliding_window,
               softcap, out) -> tuple[float, int, float]:
    """Check everything but index values; return (scale, window, softcap) with 0 meaning "off"."""
    check_tensor(q, "q", ndim=3)
    dtype_code(q, "q")
    check_tensor(k_cache, "k_cache", ndim=4, dtype=q.dtype)
    check_tensor(v_cache, "v_cache", ndim=4, dtype=q.dtype)
    check_tensor(block_tables, "block_tables", ndim=2, dtype=torch.int32)
    check_tensor(seq_lens, "seq_lens", ndim=1, dtype=torch.int32)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", ndim=1, dtype=torch.int32)
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
             ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)]
    if out is not None:
        check_tensor(out, "out", ndim=3, dtype=q.dtype)
        named.append(("out", out))
    same_device(named)

    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if kv_dim != head_dim:
        raise ValueError(f"k_cache head_dim {kv_dim} differs from q head_dim {head_dim}")
    if head_dim == 0 or num_heads == 0 or block_size == 0 or num_kv_heads == 0:
        raise ValueError(f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} must have "
                         "non-zero num_heads, head_dim, block_size and num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"q num_heads {num_heads} must be a multiple of k_cache num_kv_heads "
                         f"{num_kv_heads} (grouped-query attention)")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries but block_tables has "
                         f"{num_seqs} rows (one per sequence)")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got "
                         f"{cu_seqlens_q.shape[0]}")
    if out is not None and tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}")
    # Kernels take element strides but need unit stride on the innermost axis to vectorise.
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                    ("block_tables", block_tables)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides "
                             f"{t.stride()}")
    for name, t in (("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        check_tensor(t, name, contiguous=True)

    if scale is None:
        scale = head_dim ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite number or None, got {scale!r}")
    if sliding_window is None:
        window = 0
    elif isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    elif sliding_window < 1 or sliding_window > 2**31 - 1:
        raise ValueError(f"sliding_window must be in [1, 2**31 - 1], got {sliding_window}")
    else:
        window = int(sliding_window)
    if softcap is None:
        cap = 0.0
    elif isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
    elif not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number, got {softcap}")
    else:
        cap = float(softcap)
    return float(scale), window, cap


def check_sinks(sinks, q: torch.Tensor) -> None:
    """sinks: None or fp32 [num_heads] on q's device, contiguous."""
    if sinks is None:
        return
    check_tensor(sinks, "sinks", ndim=1, dtype=torch.float32, contiguous=True)
    same_device([("q", q), ("sinks", sinks)])
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must have one logit per q head ({q.shape[1]}), got "
                         f"{sinks.shape[0]}")


def check_values(num_tokens: int, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """Index checks on CPU tensors (the module docstring says why CUDA skips them)."""
    if block_tables.device.type != "cpu":
        return
    err = _C.paged_attention_index_error(
        block_tables.data_ptr(), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
        block_tables.shape[0], block_tables.shape[1], block_tables.stride(0), num_tokens,
        k_cache.shape[0], k_cache.shape[1])
    if err:
        raise ValueError(err)


def paged_attention_unchecked(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, *,
                              scale: float, sliding_window: int | None = None,
                              softcap: float | None = None, backend: str,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's hot path: `paged_attention` without checks or backend choice (~7 us a call
    instead of ~25 us). Only for arguments that passed `paged_attention` once with the same
    shapes, dtypes and index tensors (e.g. layer 0 of a step checks, the other layers skip);
    `backend` must be a concrete name ("cpu", "triton", "cuda", "torch"). Writes and returns out.
    """
    run_backend(backend, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                sliding_window or 0, softcap or 0.0, sinks)
    return out


@torch.library.custom_op("cb_kernels::paged_attention", mutates_args=("out",))
def _paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, out: torch.Tensor, scale: float,
                        sliding_window: int, softcap: float, backend: str,
                        sinks: torch.Tensor | None = None) -> None:
    """The registered op: arguments as `run_backend` takes them (0 = off), `out` written."""
    run_backend(backend, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                sliding_window, softcap, sinks)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
      softcap, backend, sinks=None) -> None:
    return None


def run_backend(name: str, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
                scale: float, window: int, cap: float, sinks=None) -> None:
    """Write attention into `out` with one backend; arguments already checked (0 = off,
    sinks None = off)."""
    if q.shape[0] == 0:
        return
    if name == "cpu":
        _run_cpu(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, window, cap,
                 sinks=sinks)
        return
    sliding_window = window or None
    softcap = cap or None
    if name == "torch":
        out.copy_(ref_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                      scale=scale, sliding_window=sliding_window, softcap=softcap,
                                      sinks=sinks))
        return
    if name == "triton":
        try:
            from cb_kernels.triton.paged_attention import paged_attention_triton as fn
        except ImportError as e:
            raise RuntimeError(f"the 'triton' paged_attention kernel is not available: {e}") from e
    else:
        try:
            from cb_kernels.ops.paged_attention.cuda import paged_attention_cuda as fn
        except ImportError as e:
            raise RuntimeError(f"the 'cuda' paged_attention kernel is not available: {e}") from e
    fn(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
       softcap, sinks=sinks)


def _run_cpu(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, window, cap,
             isa: str = "auto", sinks=None):
    """The C++ kernel; `isa` caps its body ("auto", "portable", "avx2", ...: one of
    _C.cpu_isas(); ValueError otherwise), for tests."""
    if not hasattr(_C, "paged_attention"):
        raise RuntimeError("the 'cpu' paged_attention kernel is not compiled into cb_kernels._C "
                           "(rebuild the extension)")
    _backend.sync_threads()
    _C.paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), out.data_ptr(),
        q.shape[0], q.shape[1], q.shape[2], block_tables.shape[0], block_tables.shape[1],
        k_cache.shape[0], k_cache.shape[1], k_cache.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        _backend.DTYPE_CODES[q.dtype], scale, window, cap, isa,
        sinks.data_ptr() if sinks is not None else 0)
