"""`gated_delta_rule`: Qwen3-Next / Qwen3.5's linear attention over a variable-length batch, the
recurrent state of each row read from and written back to its slot in place. One call runs every
row of a step, decodes (one token) and prefills (many, from zero state or from the slot) mixed.

Backends: "cpu" (csrc/cpu/gated_delta.cpp: fp32 or bf16 q/k/v, fp32 state, threads over rows x
heads), "triton" (cb_kernels/triton/gated_delta_rule.py: CUDA, or CPU tensors under
TRITON_INTERPRET=1) and "torch" (ops/reference.py's ref_gated_delta_rule).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import (DTYPE_CODES, check_tensor, default_cuda_backend,
                                     resolve_backend, same_device, sync_threads)
from cb_kernels.ops._varlen import check_values, check_varlen, rows_arg

_BACKENDS = ("triton", "cpu", "torch")


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     cu_seqlens: torch.Tensor, has_state: torch.Tensor, *,
                     scale: float | None = None, l2norm_qk: bool = True,
                     out: torch.Tensor | None = None, backend: str | None = None,
                     isa: str = "auto") -> torch.Tensor:
    """The gated delta rule of every row of a step (csrc/include/cb_kernels/gated_delta.h gives
    the recurrence; transformers' torch_recurrent_gated_delta_rule computes the same).

    Parameters
    ----------
    q, k : ``[num_tokens, num_k_heads, k_dim]`` float32 or bfloat16, last dim packed (any token
        and head strides: views into a fused projection are fine).
    v : ``[num_tokens, num_v_heads, v_dim]``, q's dtype, last dim packed; num_v_heads a multiple
        of num_k_heads (value head h reads key head ``h // (num_v_heads // num_k_heads)``).
    g : float32 ``[num_tokens, num_v_heads]``, contiguous: the log decay of each token (<= 0).
    beta : float32 ``[num_tokens, num_v_heads]``, contiguous: the write strength.
    state : float32 ``[num_slots, num_v_heads, k_dim, v_dim]``, contiguous, updated in place.
    slots : int64 ``[num_seqs]``: each row's state slot, distinct.
    cu_seqlens : int32 ``[num_seqs + 1]``: row i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``
        (0 first, num_tokens last, non-decreasing).
    has_state : bool ``[num_seqs]``: True continues from the slot, False starts from zeros.
    scale : multiplies q after its l2norm; default ``k_dim ** -0.5``.
    l2norm_qk : l2-normalise q and k first (Qwen3-Next: True).
    out : optional ``[num_tokens, num_v_heads, v_dim]`` of v's dtype, contiguous.
    backend : None (cpu for CPU tensors, triton for CUDA), "cpu", "triton" or "torch".
    isa : caps the CPU body ("auto", or one of ``_C.cpu_isas()``, for tests).

    Returns ``out``: ``[num_tokens, num_v_heads, v_dim]`` in v's dtype.
    """
    _check(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out)
    check_values(state, slots, cu_seqlens, q.shape[0])
    device = q.device
    chosen = resolve_backend(backend, device, _BACKENDS, default_cuda_backend(_BACKENDS),
                             "gated_delta_rule")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if chosen == "torch":
        from cb_kernels.ops.reference import ref_gated_delta_rule

        result = ref_gated_delta_rule(q, k, v, g, beta, state, slots, cu_seqlens, has_state,
                                      scale=scale, l2norm_qk=l2norm_qk)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = torch.empty((q.shape[0], v.shape[1], v.shape[2]), dtype=v.dtype, device=device)
    if chosen == "triton":
        from cb_kernels.triton.gated_delta_rule import gated_delta_rule_triton

        gated_delta_rule_triton(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out,
                                scale, l2norm_qk)
        return out
    _run_cpu(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out, scale, l2norm_qk, isa)
    return out


def gated_delta_rule_unchecked(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out,
                               scale: float, l2norm_qk: bool = True) -> torch.Tensor:
    """The engine's hot path on CPU: `gated_delta_rule` without the checks, for arguments the
    caller built itself (runner/hybrid_kernels.py: shapes fixed at construction, slots from the
    engine's StateSlots, cu_seqlens from the step's plan)."""
    _run_cpu(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out, scale, l2norm_qk, "auto")
    return out


def _run_cpu(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out, scale, l2norm_qk, isa):
    sync_threads()
    _C.gated_delta_rule(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
        state.data_ptr(), out.data_ptr(), rows_arg(slots, cu_seqlens, has_state, state.shape[0]),
        q.shape[1], v.shape[1], q.shape[2],
        v.shape[2], (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)),
        (v.stride(0), v.stride(1)), scale, bool(l2norm_qk), isa, DTYPE_CODES[v.dtype])


def _check(q, k, v, g, beta, state, slots, cu_seqlens, has_state, out) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=3)
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be packed (stride 1), got strides "
                             f"{t.stride()}")
    same_device([("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state),
                 ("slots", slots), ("cu_seqlens", cu_seqlens), ("has_state", has_state)])
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    num_tokens, num_k_heads, k_dim = q.shape
    if v.shape[0] != num_tokens:
        raise ValueError(f"v must have num_tokens={num_tokens} rows, got {tuple(v.shape)}")
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"v's num_v_heads ({num_v_heads}) must be a multiple of q's "
                         f"num_k_heads ({num_k_heads})")
    if k_dim == 0 or v_dim == 0:
        raise ValueError(f"k_dim and v_dim must be positive, got {k_dim}, {v_dim}")
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(t, name, ndim=2, dtype=torch.float32, contiguous=True)
        if tuple(t.shape) != (num_tokens, num_v_heads):
            raise ValueError(f"{name} must have shape {(num_tokens, num_v_heads)} "
                             f"[num_tokens, num_v_heads], got {tuple(t.shape)}")
    check_tensor(state, "state", ndim=4, dtype=torch.float32, contiguous=True)
    if tuple(state.shape[1:]) != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"state must have shape [num_slots, {num_v_heads}, {k_dim}, {v_dim}] "
                         f"[num_slots, num_v_heads, k_dim, v_dim], got {tuple(state.shape)}")
    check_varlen(slots, cu_seqlens, has_state)
    if out is not None:
        check_tensor(out, "out", ndim=3, dtype=v.dtype, device=v.device, contiguous=True)
        if tuple(out.shape) != (num_tokens, num_v_heads, v_dim):
            raise ValueError(f"out must have shape {(num_tokens, num_v_heads, v_dim)}, got "
                             f"{tuple(out.shape)}")


@torch.library.custom_op("cb_kernels::gated_delta_rule", mutates_args=("state",))
def _gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                         cu_seqlens: torch.Tensor, has_state: torch.Tensor,
                         scale: float) -> torch.Tensor:
    return gated_delta_rule(q, k, v, g, beta, state, slots, cu_seqlens, has_state, scale=scale)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, state, slots, cu_seqlens, has_state, scale) -> torch.Tensor:
    _check(q, k, v, g, beta, state, slots, cu_seqlens, has_state, None)
    return v.new_empty((q.shape[0], v.shape[1], v.shape[2]))
