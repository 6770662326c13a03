"""`causal_conv1d`: the short causal depthwise conv1d with its state over a variable-length batch
(the conv before Qwen3-Next's gated delta rule; Mamba-2's and LFM2's short convolutions), each
row's window read from and written back to its slot in place. One call runs every row of a step.

Backends: "cpu" (csrc/cpu/causal_conv1d.cpp, fp32 or bf16), "triton"
(cb_kernels/triton/causal_conv1d.py: CUDA, or CPU tensors under TRITON_INTERPRET=1) and "torch"
(ops/reference.py's ref_causal_conv1d).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import (DTYPE_CODES, check_tensor, default_cuda_backend,
                                     resolve_backend, same_device, sync_threads)
from cb_kernels.ops._varlen import check_values, check_varlen, rows_arg

_BACKENDS = ("triton", "cpu", "torch")
_ACTIVATIONS = (None, "silu")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                  has_state: torch.Tensor, *, activation: str | None = "silu",
                  backend: str | None = None, isa: str = "auto") -> torch.Tensor:
    """Per row: ``act(bias + depthwise causal conv of its tokens)``, preceded by the last
    ``width - 1`` inputs of its slot's window when ``has_state`` (zeros otherwise); afterwards
    the slot holds the row's last ``state_len`` inputs (older ones from the old window or zeros).

    Parameters
    ----------
    x : ``[num_tokens, channels]`` float32 or bfloat16, channels packed (tokens any stride).
    weight : ``[channels, width]`` of x's dtype, contiguous, width <= 16.
    bias : ``[channels]`` of x's dtype, or None.
    conv_state : ``[num_slots, channels, state_len]`` of x's dtype, contiguous, state_len >=
        width - 1 (transformers keeps state_len = width), updated in place.
    slots : int64 ``[num_seqs]``, distinct; cu_seqlens : int32 ``[num_seqs + 1]``;
    has_state : bool ``[num_seqs]`` (see ops.gated_delta_rule).
    activation : None or "silu".
    backend : None (cpu for CPU tensors, triton for CUDA), "cpu", "triton" or "torch".
    isa : caps the CPU body ("auto", or one of ``_C.cpu_isas()``, for tests): "avx512" or
        "portable" run (``_C.gated_delta_rule_isa`` names the one chosen, the same two bodies).

    Returns ``[num_tokens, channels]`` in x's dtype, contiguous.
    """
    _check(x, weight, bias, conv_state, slots, cu_seqlens, has_state, activation)
    check_values(conv_state, slots, cu_seqlens, x.shape[0])
    chosen = resolve_backend(backend, x.device, _BACKENDS, default_cuda_backend(_BACKENDS),
                             "causal_conv1d")
    if chosen == "torch":
        from cb_kernels.ops.reference import ref_causal_conv1d

        return ref_causal_conv1d(x, weight, bias, conv_state, slots, cu_seqlens, has_state,
                                 activation=activation)
    if chosen == "triton":
        from cb_kernels.triton.causal_conv1d import causal_conv1d_triton

        out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        causal_conv1d_triton(x, weight, bias, conv_state, slots, cu_seqlens, has_state, out,
                             activation == "silu")
        return out
    return causal_conv1d_unchecked(x, weight, bias, conv_state, slots, cu_seqlens, has_state,
                                   activation, isa)


def causal_conv1d_unchecked(x, weight, bias, conv_state, slots, cu_seqlens, has_state,
                            activation, isa: str = "auto") -> torch.Tensor:
    """The engine's hot path on CPU: `causal_conv1d` without the checks (runner/hybrid_kernels.py
    builds the arguments)."""
    out = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype)
    sync_threads()
    _C.causal_conv1d(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                     conv_state.data_ptr(), out.data_ptr(),
                     rows_arg(slots, cu_seqlens, has_state, conv_state.shape[0]), x.shape[1],
                     weight.shape[1], conv_state.shape[2], x.stride(0), activation == "silu",
                     isa, DTYPE_CODES[x.dtype])
    return out


def _check(x, weight, bias, conv_state, slots, cu_seqlens, has_state, activation) -> None:
    check_tensor(x, "x", ndim=2)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x's channels must be packed (stride 1), got strides {x.stride()}")
    channels = x.shape[1]
    if channels == 0:
        raise ValueError("x must have at least one channel")
    check_conv_weights(weight, bias, conv_state, channels, x.dtype)
    check_varlen(slots, cu_seqlens, has_state)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    tensors = [("x", x), ("weight", weight), ("conv_state", conv_state), ("slots", slots),
               ("cu_seqlens", cu_seqlens), ("has_state", has_state)]
    same_device(tensors + ([("bias", bias)] if bias is not None else []))


def check_conv_weights(weight, bias, conv_state, channels: int, dtype, *,
                       names: tuple[str, str] = ("weight", "bias")) -> None:
    """The conv's weight ``[channels, width]`` (1 <= width <= 16), bias ``[channels]`` or None
    and conv_state ``[num_slots, channels, state_len >= width - 1]``, each of `dtype` and
    contiguous. `names`: the weight's and the bias' argument names in the messages (the fused
    ops call them conv_weight and conv_bias)."""
    weight_name, bias_name = names
    check_tensor(weight, weight_name, ndim=2, dtype=dtype, contiguous=True)
    if weight.shape[0] != channels or not 1 <= weight.shape[1] <= 16:
        raise ValueError(f"{weight_name} must have shape [{channels}, width] with 1 <= width "
                         f"<= 16, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(bias, bias_name, ndim=1, dtype=dtype, contiguous=True)
        if bias.shape[0] != channels:
            raise ValueError(f"{bias_name} must have shape [{channels}], got "
                             f"{tuple(bias.shape)}")
    check_tensor(conv_state, "conv_state", ndim=3, dtype=dtype, contiguous=True)
    if conv_state.shape[1] != channels or conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"conv_state must have shape [num_slots, {channels}, state_len >= "
                         f"{weight.shape[1] - 1}], got {tuple(conv_state.shape)}")


@torch.library.custom_op("cb_kernels::causal_conv1d", mutates_args=("conv_state",))
def _causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                      has_state: torch.Tensor, silu: bool) -> torch.Tensor:
    return causal_conv1d(x, weight, bias, conv_state, slots, cu_seqlens, has_state,
                         activation="silu" if silu else None)


@_causal_conv1d_op.register_fake
def _(x, weight, bias, conv_state, slots, cu_seqlens, has_state, silu) -> torch.Tensor:
    _check(x, weight, bias, conv_state, slots, cu_seqlens, has_state, "silu" if silu else None)
    return x.new_empty(x.shape)
