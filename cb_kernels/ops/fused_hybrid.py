"""The stateful middle of a hybrid layer in one call: what runs between its input and output
projections (csrc/cpu/fused_hybrid.cpp says why; cb_kernels/fused_hybrid.h what it computes).

- ``gated_delta_net``: Qwen3-Next's gated delta-net after in_proj_qkvz / in_proj_ba: the split
  into the conv's channel order, ``causal_conv1d`` + SiLU, the gates (``beta = sigmoid(b)``,
  ``g = softplus(a + dt_bias) * neg_a``), ``gated_delta_rule`` and the gated RMSNorm with z.
- ``mamba2_mixer``: a Mamba-2 mixer after in_proj: ``causal_conv1d`` + SiLU of xBC,
  ``selective_scan`` with dt (softplus, no clamp) and the grouped gated RMSNorm with the gate.

Both update the conv and recurrent state slots in place, for every row of a step (decodes and
prefills mixed). ``ref_gated_delta_net`` / ``ref_mamba2_mixer`` compose ops/reference.py's
references of the same steps; the CPU call runs the ops' own kernels, so it agrees with them
to their tolerances (the gates' exp/log1p may differ from torch's in the last bit). CPU,
float32 or bfloat16.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES, check_tensor, sync_threads
from cb_kernels.ops._varlen import check_values, check_varlen, rows_arg
from cb_kernels.ops.causal_conv1d import check_conv_weights
from cb_kernels.ops.reference import (ref_causal_conv1d, ref_gated_delta_rule,
                                      ref_gated_rms_norm, ref_selective_scan)
from cb_kernels.ops import workspace

_DTYPES = (torch.float32, torch.bfloat16)


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _check_common(x, name, conv_weight, conv_bias, conv_state, state, slots, cu_seqlens,
                  has_state, conv_dim: int) -> None:
    check_tensor(x, name, ndim=2)
    if x.dtype not in _DTYPES or x.device.type != "cpu":
        raise TypeError(f"{name} must be a float32 or bfloat16 CPU tensor, got {x.dtype} on "
                        f"{x.device}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be packed (stride 1), got strides {x.stride()}")
    check_conv_weights(conv_weight, conv_bias, conv_state, conv_dim, x.dtype,
                       names=("conv_weight", "conv_bias"))
    check_tensor(state, "state", ndim=4, dtype=torch.float32, contiguous=True)
    if state.shape[0] != conv_state.shape[0]:
        raise ValueError(f"state and conv_state must have the same num_slots, got "
                         f"{state.shape[0]} and {conv_state.shape[0]}")
    check_varlen(slots, cu_seqlens, has_state)
    check_values(state, slots, cu_seqlens, x.shape[0])


def _check_vector(t, name: str, n: int, dtype) -> None:
    check_tensor(t, name, ndim=1, dtype=dtype, contiguous=True)
    if t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")


def gated_delta_net(qkvz, ba, conv_weight, conv_bias, conv_state, state, dt_bias, neg_a,
                    norm_weight, slots, cu_seqlens, has_state, *, num_k_heads: int,
                    num_v_heads: int, k_dim: int, v_dim: int, scale: float, norm_eps: float,
                    isa: str = "auto") -> torch.Tensor:
    """A gated delta-net layer between its projections, state slots updated in place.

    Parameters
    ----------
    qkvz : ``[num_tokens, num_k_heads * (2 k_dim + 2 ratio v_dim)]`` float32 or bfloat16 CPU
        (ratio = num_v_heads / num_k_heads): per key head q, k, v, z (in_proj_qkvz's output);
        rows any stride, elements packed.
    ba : ``[num_tokens, num_k_heads * 2 ratio]``: per key head b, a (in_proj_ba's output).
    conv_weight : ``[conv_dim, width]`` (conv_dim = 2 num_k_heads k_dim + num_v_heads v_dim);
        conv_bias : ``[conv_dim]`` or None; conv_state : ``[num_slots, conv_dim, state_len]``.
    state : float32 ``[num_slots, num_v_heads, k_dim, v_dim]``.
    dt_bias : ``[num_v_heads]`` (qkvz's dtype); neg_a : float32 ``[num_v_heads]``
        (``-exp(A_log)``); norm_weight : ``[v_dim]``.
    slots, cu_seqlens, has_state : the rows (ops/_varlen.py).
    scale : q's scale after its l2norm; norm_eps : the gated norm's eps.
    isa : caps the kernels' bodies ("auto", "portable", "avx512"; for tests).

    Returns ``[num_tokens, num_v_heads * v_dim]`` in qkvz's dtype.
    """
    if num_k_heads <= 0 or num_v_heads % num_k_heads or k_dim <= 0 or v_dim <= 0:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
                         f"({num_k_heads}) > 0, k_dim ({k_dim}) and v_dim ({v_dim}) positive")
    r = num_v_heads // num_k_heads
    conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    _check_common(qkvz, "qkvz", conv_weight, conv_bias, conv_state, state, slots, cu_seqlens,
                  has_state, conv_dim)
    width = num_k_heads * (2 * k_dim + 2 * r * v_dim)
    if qkvz.shape[1] != width:
        raise ValueError(f"qkvz must have {width} columns, got {qkvz.shape[1]}")
    check_tensor(ba, "ba", ndim=2, dtype=qkvz.dtype)
    if tuple(ba.shape) != (qkvz.shape[0], num_k_heads * 2 * r) or ba.stride(-1) != 1:
        raise ValueError(f"ba must be [{qkvz.shape[0]}, {num_k_heads * 2 * r}] with packed "
                         f"rows, got {tuple(ba.shape)} strides {ba.stride()}")
    if tuple(state.shape[1:]) != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"state must be [num_slots, {num_v_heads}, {k_dim}, {v_dim}], got "
                         f"{tuple(state.shape)}")
    _check_vector(dt_bias, "dt_bias", num_v_heads, qkvz.dtype)
    _check_vector(neg_a, "neg_a", num_v_heads, torch.float32)
    _check_vector(norm_weight, "norm_weight", v_dim, qkvz.dtype)
    return gated_delta_net_unchecked(qkvz, ba, conv_weight, conv_bias, conv_state, state,
                                     dt_bias, neg_a, norm_weight, slots, cu_seqlens, has_state,
                                     num_k_heads, num_v_heads, k_dim, v_dim, scale, norm_eps, isa)


def gated_delta_net_unchecked(qkvz, ba, conv_weight, conv_bias, conv_state, state, dt_bias,
                              neg_a, norm_weight, slots, cu_seqlens, has_state,
                              num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                              scale: float, norm_eps: float, isa: str = "auto") -> torch.Tensor:
    """The engine's hot path (runner/hybrid_kernels.py): `gated_delta_net` without the checks."""
    rows = rows_arg(slots, cu_seqlens, has_state, state.shape[0])
    size = (num_k_heads, num_v_heads, k_dim, v_dim, conv_weight.shape[1], conv_state.shape[2],
            qkvz.stride(0), ba.stride(0))
    code = DTYPE_CODES[qkvz.dtype]
    n = qkvz.shape[0]
    out = torch.empty((n, num_v_heads * v_dim), dtype=qkvz.dtype)
    ws = workspace.scratch(_C.gated_delta_net_workspace_bytes(rows, size, code))
    sync_threads()
    _C.gated_delta_net((qkvz.data_ptr(), ba.data_ptr(), conv_weight.data_ptr(), _ptr(conv_bias),
                        conv_state.data_ptr(), state.data_ptr(), dt_bias.data_ptr(),
                        neg_a.data_ptr(), norm_weight.data_ptr(), out.data_ptr(), ws.data_ptr()),
                       rows, size, float(scale), float(norm_eps), isa, code)
    return out


def ref_gated_delta_net(qkvz, ba, conv_weight, conv_bias, conv_state, state, dt_bias, neg_a,
                        norm_weight, slots, cu_seqlens, has_state, *, num_k_heads: int,
                        num_v_heads: int, k_dim: int, v_dim: int, scale: float,
                        norm_eps: float) -> torch.Tensor:
    """transformers' Qwen3NextGatedDeltaNet between its projections, on the references of each
    step (the split and gates as its torch ops write them)."""
    n, nk, r = qkvz.shape[0], num_k_heads, num_v_heads // num_k_heads
    x = qkvz.reshape(n, nk, -1)
    q, k = x[..., :k_dim], x[..., k_dim:2 * k_dim]
    v, z = x[..., 2 * k_dim:2 * k_dim + r * v_dim], x[..., 2 * k_dim + r * v_dim:]
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    conv = ref_causal_conv1d(mixed, conv_weight, conv_bias, conv_state, slots, cu_seqlens,
                             has_state, activation="silu")
    kd = nk * k_dim
    b, a = ba.reshape(n, nk, 2 * r)[..., :r], ba.reshape(n, nk, 2 * r)[..., r:]
    beta = b.sigmoid().float().reshape(n, num_v_heads)
    g = F.softplus(a.float().reshape(n, num_v_heads) + dt_bias) * neg_a
    core = ref_gated_delta_rule(conv[:, :kd].reshape(n, nk, k_dim),
                                conv[:, kd:2 * kd].reshape(n, nk, k_dim),
                                conv[:, 2 * kd:].reshape(n, num_v_heads, v_dim), g, beta, state,
                                slots, cu_seqlens, has_state, scale=scale)
    return ref_gated_rms_norm(core.reshape(n, -1), z.reshape(n, -1), norm_weight, norm_eps,
                              group_size=v_dim, norm_before_gate=True)


def mamba2_mixer(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias, norm_weight,
                 slots, cu_seqlens, has_state, *, num_heads: int, head_dim: int,
                 num_groups: int, d_state: int, norm_group_size: int, norm_eps: float,
                 isa: str = "auto") -> torch.Tensor:
    """A Mamba-2 mixer between its projections, state slots updated in place.

    Parameters
    ----------
    proj : ``[num_tokens, inner + conv_dim + num_heads]`` float32 or bfloat16 CPU (in_proj's
        output: gate, xBC, dt; inner = num_heads head_dim, conv_dim = inner + 2 num_groups
        d_state); rows any stride, elements packed.
    conv_weight : ``[conv_dim, width]``; conv_bias : ``[conv_dim]`` or None;
        conv_state : ``[num_slots, conv_dim, state_len]``.
    state : float32 ``[num_slots, num_heads, head_dim, d_state]``.
    A, D, dt_bias : float32 ``[num_heads]`` (A = ``-exp(A_log)``); norm_weight : ``[inner]``.
    norm_group_size : elements the gated norm normalises together (inner // n_groups).
    isa : caps the kernels' bodies (tests).

    Returns ``[num_tokens, inner]`` in proj's dtype.
    """
    if num_heads <= 0 or num_groups <= 0 or num_heads % num_groups or head_dim <= 0 or \
            d_state <= 0 or norm_group_size <= 0 or (num_heads * head_dim) % norm_group_size:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_groups "
                         f"({num_groups}), head_dim ({head_dim}) and d_state ({d_state}) "
                         f"positive, norm_group_size ({norm_group_size}) dividing "
                         f"num_heads * head_dim")
    inner = num_heads * head_dim
    conv_dim = inner + 2 * num_groups * d_state
    _check_common(proj, "proj", conv_weight, conv_bias, conv_state, state, slots, cu_seqlens,
                  has_state, conv_dim)
    if proj.shape[1] != inner + conv_dim + num_heads:
        raise ValueError(f"proj must have {inner + conv_dim + num_heads} columns (gate, xBC, "
                         f"dt), got {proj.shape[1]}")
    if tuple(state.shape[1:]) != (num_heads, head_dim, d_state):
        raise ValueError(f"state must be [num_slots, {num_heads}, {head_dim}, {d_state}], got "
                         f"{tuple(state.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        _check_vector(t, name, num_heads, torch.float32)
    _check_vector(norm_weight, "norm_weight", inner, proj.dtype)
    return mamba2_mixer_unchecked(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias,
                                  norm_weight, slots, cu_seqlens, has_state, num_heads, head_dim,
                                  num_groups, d_state, norm_group_size, norm_eps, isa)


def mamba2_mixer_unchecked(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias,
                           norm_weight, slots, cu_seqlens, has_state, num_heads: int,
                           head_dim: int, num_groups: int, d_state: int, norm_group_size: int,
                           norm_eps: float, isa: str = "auto") -> torch.Tensor:
    """The engine's hot path (runner/hybrid_kernels.py): `mamba2_mixer` without the checks."""
    rows = rows_arg(slots, cu_seqlens, has_state, state.shape[0])
    size = (num_heads, head_dim, num_groups, d_state, norm_group_size, conv_weight.shape[1],
            conv_state.shape[2], proj.stride(0))
    code = DTYPE_CODES[proj.dtype]
    out = torch.empty((proj.shape[0], num_heads * head_dim), dtype=proj.dtype)
    ws = workspace.scratch(_C.mamba2_mixer_workspace_bytes(rows, size, code))
    sync_threads()
    _C.mamba2_mixer((proj.data_ptr(), conv_weight.data_ptr(), _ptr(conv_bias),
                     conv_state.data_ptr(), state.data_ptr(), A.data_ptr(), D.data_ptr(),
                     dt_bias.data_ptr(), norm_weight.data_ptr(), out.data_ptr(), ws.data_ptr()),
                    rows, size, float(norm_eps), isa, code)
    return out


def ref_mamba2_mixer(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias,
                     norm_weight, slots, cu_seqlens, has_state, *, num_heads: int,
                     head_dim: int, num_groups: int, d_state: int, norm_group_size: int,
                     norm_eps: float) -> torch.Tensor:
    """transformers' Mamba-2 mixer between its projections, on the references of each step."""
    n, inner = proj.shape[0], num_heads * head_dim
    bc = num_groups * d_state
    gate, xbc, dt = proj.split([inner, inner + 2 * bc, num_heads], dim=-1)
    conv = ref_causal_conv1d(xbc, conv_weight, conv_bias, conv_state, slots, cu_seqlens,
                             has_state, activation="silu")
    y = ref_selective_scan(conv[:, :inner].reshape(n, num_heads, head_dim), dt.float(), A,
                           conv[:, inner:inner + bc].reshape(n, num_groups, d_state),
                           conv[:, inner + bc:].reshape(n, num_groups, d_state), state, slots,
                           cu_seqlens, has_state, D=D, dt_bias=dt_bias)
    return ref_gated_rms_norm(y.reshape(n, inner), gate, norm_weight, norm_eps,
                              group_size=norm_group_size, norm_before_gate=False)


# torch.library ops, so torch.compile can trace the calls (eager calls skip the dispatch).
@torch.library.custom_op("cb_kernels::gated_delta_net", mutates_args=("conv_state", "state"))
def _gated_delta_net_op(qkvz: torch.Tensor, ba: torch.Tensor, conv_weight: torch.Tensor,
                        conv_bias: Optional[torch.Tensor], conv_state: torch.Tensor,
                        state: torch.Tensor, dt_bias: torch.Tensor, neg_a: torch.Tensor,
                        norm_weight: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                        has_state: torch.Tensor, num_k_heads: int, num_v_heads: int, k_dim: int,
                        v_dim: int, scale: float, norm_eps: float) -> torch.Tensor:
    return gated_delta_net(qkvz, ba, conv_weight, conv_bias, conv_state, state, dt_bias, neg_a,
                           norm_weight, slots, cu_seqlens, has_state, num_k_heads=num_k_heads,
                           num_v_heads=num_v_heads, k_dim=k_dim, v_dim=v_dim, scale=scale,
                           norm_eps=norm_eps)


@_gated_delta_net_op.register_fake
def _(qkvz, ba, conv_weight, conv_bias, conv_state, state, dt_bias, neg_a, norm_weight, slots,
      cu_seqlens, has_state, num_k_heads, num_v_heads, k_dim, v_dim, scale, norm_eps):
    return qkvz.new_empty((qkvz.shape[0], num_v_heads * v_dim))


@torch.library.custom_op("cb_kernels::mamba2_mixer", mutates_args=("conv_state", "state"))
def _mamba2_mixer_op(proj: torch.Tensor, conv_weight: torch.Tensor,
                     conv_bias: Optional[torch.Tensor], conv_state: torch.Tensor,
                     state: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, slots: torch.Tensor,
                     cu_seqlens: torch.Tensor, has_state: torch.Tensor, num_heads: int,
                     head_dim: int, num_groups: int, d_state: int, norm_group_size: int,
                     norm_eps: float) -> torch.Tensor:
    return mamba2_mixer(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias,
                        norm_weight, slots, cu_seqlens, has_state, num_heads=num_heads,
                        head_dim=head_dim, num_groups=num_groups, d_state=d_state,
                        norm_group_size=norm_group_size, norm_eps=norm_eps)


@_mamba2_mixer_op.register_fake
def _(proj, conv_weight, conv_bias, conv_state, state, A, D, dt_bias, norm_weight, slots,
      cu_seqlens, has_state, num_heads, head_dim, num_groups, d_state, norm_group_size,
      norm_eps):
    return proj.new_empty((proj.shape[0], num_heads * head_dim))


def mamba2_block_unchecked(x, norm_weight, norm_eps: float, in_proj, out_proj, conv_weight,
                           conv_bias, conv_state, state, A, D, dt_bias, gate_norm_weight,
                           slots, cu_seqlens, has_state, num_heads: int, head_dim: int,
                           num_groups: int, d_state: int, norm_group_size: int,
                           gate_norm_eps: float, isa: str = "auto") -> torch.Tensor:
    """A whole Mamba-2 block in one call, for the engine's forward (runner/hybrid_layers.py),
    no checks: ``x += out_proj(mamba2_mixer(in_proj(rms_norm(x.to(dtype)))))`` in place.

    x : contiguous ``[num_tokens, hidden]``, float32 (the fp32 residual stream) or the layer's
    dtype; norm_weight : ``[hidden]`` (the block's RMSNorm, Llama's formula); in_proj, out_proj:
    ops.PackedLinear of the layer's dtype (in_proj's rows gate, xBC, dt); the rest as
    `mamba2_mixer` (gate_norm_*: the mixer's gated norm). The same kernels as the separate calls,
    the same bits (tests/ops/test_fused_hybrid.py). Returns x."""
    rows = rows_arg(slots, cu_seqlens, has_state, state.shape[0])
    dtype = in_proj.dtype
    size = (num_heads, head_dim, num_groups, d_state, norm_group_size, conv_weight.shape[1],
            conv_state.shape[2], 0)
    hidden = x.shape[1]
    code = DTYPE_CODES[dtype]
    ws = workspace.scratch(_C.mamba2_block_workspace_bytes(rows, size, hidden, code))
    sync_threads()
    _C.mamba2_block((x.data_ptr(), norm_weight.data_ptr(), in_proj.packed.data_ptr(),
                     _ptr(in_proj.bias), out_proj.packed.data_ptr(), _ptr(out_proj.bias),
                     ws.data_ptr()),
                    (0, conv_weight.data_ptr(), _ptr(conv_bias), conv_state.data_ptr(),
                     state.data_ptr(), A.data_ptr(), D.data_ptr(), dt_bias.data_ptr(),
                     gate_norm_weight.data_ptr(), 0, 0),
                    rows, size, hidden, float(norm_eps), float(gate_norm_eps), isa,
                    DTYPE_CODES[x.dtype], code)
    return x


def _one_row(num_tokens: int) -> tuple:
    """(slots, cu_seqlens, has_state) of one sequence of num_tokens rows: what the
    *_workspace_bytes functions size a step by (they read cu_seqlens alone)."""
    return (torch.zeros(1, dtype=torch.int64), torch.tensor([0, num_tokens], dtype=torch.int32),
            torch.zeros(1, dtype=torch.bool))


def mamba2_block_workspace_bytes(num_tokens: int, hidden: int, dtype: torch.dtype,
                                 num_heads: int, head_dim: int, num_groups: int, d_state: int,
                                 norm_group_size: int, conv_width: int, state_len: int) -> int:
    """Scratch bytes of a `mamba2_block_unchecked` call over num_tokens rows (dtype: the
    layer's), for sizing ops/workspace.py's buffer before the first step."""
    size = (num_heads, head_dim, num_groups, d_state, norm_group_size, conv_width, state_len, 0)
    row = _one_row(num_tokens)       # alive through the call that reads its pointers
    return _C.mamba2_block_workspace_bytes(rows_arg(*row, 1), size, hidden, DTYPE_CODES[dtype])


def gated_delta_net_block_workspace_bytes(num_tokens: int, hidden: int, dtype: torch.dtype,
                                          num_k_heads: int, num_v_heads: int, k_dim: int,
                                          v_dim: int, conv_width: int, state_len: int) -> int:
    """Scratch bytes of a `gated_delta_net_block_unchecked` call over num_tokens rows, as
    `mamba2_block_workspace_bytes`."""
    size = (num_k_heads, num_v_heads, k_dim, v_dim, conv_width, state_len, 0, 0)
    row = _one_row(num_tokens)
    return _C.gated_delta_net_block_workspace_bytes(rows_arg(*row, 1), size, hidden,
                                                    DTYPE_CODES[dtype])


def gated_delta_net_block_unchecked(x, pending, in_norm_weight, in_norm_eps: float,
                                    post_norm_weight, post_norm_eps: float, qkvz_proj, ba_proj,
                                    out_proj, conv_weight, conv_bias, conv_state, state,
                                    dt_bias, neg_a, gate_norm_weight, slots, cu_seqlens,
                                    has_state, num_k_heads: int, num_v_heads: int, k_dim: int,
                                    v_dim: int, scale: float, gate_norm_eps: float,
                                    isa: str = "auto") -> torch.Tensor:
    """A Qwen3-Next gated delta-net layer up to its MLP in one call, for the engine's forward
    (runner/hybrid_layers.py), no checks: ``x += pending``, ``h = offset_rms_norm(x)``,
    ``x += out_proj(gated_delta_net(qkvz_proj(h), ba_proj(h)))`` in place; returns the post
    norm ``offset_rms_norm(x)`` as a new ``[num_tokens, hidden]``.

    x : contiguous ``[num_tokens, hidden]`` of the layer's dtype; pending : the same shape
    (the previous MLP's output) or None; *_norm_weight : ``[hidden]`` (Qwen3-Next's (1 + w)
    norms); qkvz_proj, ba_proj, out_proj : ops.PackedLinear of the layer's dtype; the rest as
    `gated_delta_net`. The same kernels as the separate calls, the same bits
    (tests/ops/test_fused_hybrid.py)."""
    rows = rows_arg(slots, cu_seqlens, has_state, state.shape[0])
    size = (num_k_heads, num_v_heads, k_dim, v_dim, conv_weight.shape[1], conv_state.shape[2],
            0, 0)
    n, hidden = x.shape
    code = DTYPE_CODES[x.dtype]
    ws = workspace.scratch(_C.gated_delta_net_block_workspace_bytes(rows, size, hidden, code))
    h_out = torch.empty((n, hidden), dtype=x.dtype)
    sync_threads()
    _C.gated_delta_net_block(
        (x.data_ptr(), _ptr(pending), in_norm_weight.data_ptr(), post_norm_weight.data_ptr(),
         qkvz_proj.packed.data_ptr(), _ptr(qkvz_proj.bias), ba_proj.packed.data_ptr(),
         _ptr(ba_proj.bias), out_proj.packed.data_ptr(), _ptr(out_proj.bias), h_out.data_ptr()),
        (0, 0, conv_weight.data_ptr(), _ptr(conv_bias), conv_state.data_ptr(), state.data_ptr(),
         dt_bias.data_ptr(), neg_a.data_ptr(), gate_norm_weight.data_ptr(), 0, ws.data_ptr()),
        rows, size, hidden, (float(in_norm_eps), float(post_norm_eps), float(scale),
                             float(gate_norm_eps)), isa, code)
    return h_out
