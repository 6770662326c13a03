"""Shared plumbing of the op wrappers: dtype codes, argument checks, backend choice.

Every check raises ValueError/TypeError naming the argument; nothing here copies or casts a tensor.
"""
from __future__ import annotations

import functools
import os
from typing import Iterable

import torch

from cb_kernels import _C

BACKENDS = ("cuda", "triton", "cpu", "torch")

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(t: torch.Tensor, name: str) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}") from None


def check_tensor(t, name: str, *, ndim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, contiguous: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def sync_threads() -> None:
    """Keep the C++ kernels' OpenMP team equal to torch's intra-op thread count."""
    n = torch.get_num_threads()
    if n != _sync_threads_last[0]:
        _C.set_num_threads(n)
        _sync_threads_last[0] = n


_sync_threads_last = [-1]


@functools.lru_cache(maxsize=None)
def cuda_kernels_error() -> str:
    """"" when the compiled CUDA kernels can run here, else why not (for error messages)."""
    if not _C.build_info["cuda_compiled"]:
        return _C.cuda_device_error()
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return _C.cuda_device_error()


def require_cuda_kernels() -> None:
    err = cuda_kernels_error()
    if err:
        raise RuntimeError(f"the 'cuda' backend cannot run on this machine: {err}")


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def triton_error() -> str:
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({e})"
    if not torch.cuda.is_available() and not triton_interpret():
        return "no GPU for triton (set TRITON_INTERPRET=1 to run its kernels on CPU tensors, slowly)"
    return ""


def available_backends() -> list[str]:
    """Backends that can run on this machine, fastest first: subset of cuda, triton, cpu, torch."""
    out = []
    if not cuda_kernels_error():
        out.append("cuda")
    if not triton_error():
        out.append("triton")
    out += ["cpu", "torch"]
    return out


def default_cuda_backend(supported: tuple[str, ...]) -> str:
    """The backend an op without a measured CUDA default takes for CUDA tensors: the compiled
    kernels where the op has them and they run, else Triton where the op has it, else the
    reference."""
    if "cuda" in supported and not cuda_kernels_error():
        return "cuda"
    if "triton" in supported and not triton_error():
        return "triton"
    return "torch"


def resolve_backend(requested: str | None, device: torch.device, supported: tuple[str, ...],
                    default_cuda: str, op: str) -> str:
    """Pick the backend for one call.

    `requested=None` takes the op's measured default for the device (`default_cuda` on CUDA,
    the C++ kernels on CPU). An explicit request is honoured or rejected with the reason.
    """
    if requested is None:
        return default_cuda if device.type == "cuda" else "cpu"
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {requested!r}")
    if requested not in supported:
        raise ValueError(f"{op} has no {requested!r} backend (it has {tuple(supported)})")
    if requested == "cuda":
        require_cuda_kernels()
        if device.type != "cuda":
            raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device}")
    elif requested == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}")
    elif requested == "triton":
        err = triton_error()
        if err:
            raise RuntimeError(f"the 'triton' backend cannot run here: {err}")
        if device.type == "cpu" and not triton_interpret():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
    return requested


def same_device(tensors: Iterable[tuple[str, torch.Tensor]]) -> torch.device:
    it = iter(tensors)
    first_name, first = next(it)
    for name, t in it:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")
    return first.device
