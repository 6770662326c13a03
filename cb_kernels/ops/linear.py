"""fp32 and bf16 linear layers on CPU on a weight packed once (csrc/cpu/linear.cpp,
csrc/cpu/linear_bf16.cpp).

    lin = PackedLinear(torch.cat([q.weight, k.weight, v.weight]), bias=None)
    y = lin(x)                       # x [..., k] fp32 CPU -> [..., n] == F.linear to fp32 rounding

A bf16 weight packs for the bf16 kernel (AVX512-BF16 vdpbf16ps where the CPU has it, a portable
body with the same adds elsewhere): x and y are bf16, sums fp32 (bias added in fp32), y rounded
once; `PackedLinear.fast(torch.bfloat16)` says whether the vdpbf16ps body runs.

Every output is one fused multiply-add chain over k in order (plus the bias), so a row's result
does not depend on the other rows of the batch, the thread count or the ISA body (AVX-512, AVX2
or plain C++, chosen at run time). The engine's packed linears (runner/packed_linears.py) use it
where `PackedLinear.fast()` (AVX-512); the kernel file says what it measured against oneDNN.
"""
from __future__ import annotations

from typing import Optional

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import sync_threads


class PackedLinear:
    """A packed copy of an fp32 or bf16 CPU weight [n, k] (and bias [n], same dtype); call it on
    x [..., k] of that dtype."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        for name, t, dims in (("weight", weight, 2), ("bias", bias, 1)):
            if t is None and name == "bias":
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != dims or t.device.type != "cpu" or \
                    t.dtype not in (torch.float32, torch.bfloat16) or t.dtype != weight.dtype:
                raise ValueError(f"{name} must be a {dims}-D fp32 or bf16 CPU tensor (bias of "
                                 f"the weight's dtype), got shape {tuple(t.shape)}, {t.dtype} on "
                                 f"{t.device}")
        self.dtype = weight.dtype
        self.n, self.k = weight.shape
        if self.n == 0 or self.k == 0:
            raise ValueError(f"weight must be non-empty, got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape[0] != self.n:
            raise ValueError(f"bias must have {self.n} entries, got {bias.shape[0]}")
        w = weight.detach().contiguous()
        if self.dtype == torch.bfloat16:
            self.packed = torch.empty(_C.linear_bf16_packed_elems(self.n, self.k),
                                      dtype=torch.bfloat16)
            _C.linear_bf16_pack(w.data_ptr(), self.n, self.k, self.k, self.packed.data_ptr())
            self.bias = None if bias is None else bias.detach().float().contiguous()
        else:
            self.packed = torch.empty(_C.linear_packed_floats(self.n, self.k), dtype=torch.float32)
            _C.linear_pack(w.data_ptr(), self.n, self.k, self.k, self.packed.data_ptr())
            self.bias = None if bias is None else bias.detach().contiguous().clone()

    @staticmethod
    def fast(dtype: torch.dtype = torch.float32) -> bool:
        """fp32: True where the AVX-512 body runs, the one measured faster than oneDNN's packed
        GEMM (the AVX2 body gives the same bits at 0.65x (16 rows) to 0.87x (512 rows) of
        oneDNN's speed, measured on the Zen 4 with the body forced, so the engine keeps oneDNN
        there). bf16: True where the AVX512-BF16 body runs (the portable one is a reference)."""
        if dtype == torch.bfloat16:
            return _C.linear_bf16_isa() == "avx512_bf16"
        return _C.linear_isa() == "avx512"

    def __call__(self, x: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
        """x: fp32 CPU [..., k]. Returns a new [..., n] tensor. `isa` caps the body (tests):
        "auto" or one of _C.cpu_isas() ("portable", "avx2", "avx512", ...); ValueError else."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.k:
            raise ValueError(f"x must be a [..., {self.k}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device.type != "cpu" or x.dtype != self.dtype:
            raise ValueError(f"x must be {self.dtype} on the CPU (the weight's dtype), got "
                             f"{x.dtype} on {x.device}")
        return self.run_unchecked(x, isa)

    def run_unchecked(self, x: torch.Tensor, isa: str = "auto",
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """__call__ without the argument checks, for callers that own them (the engine's
        packed linears). `out`: a contiguous [rows, n] tensor of the weight's dtype to write
        into and return (its view), where the caller keeps a workspace (runner/lm_head.py: a
        fresh 100 MB logits tensor a step cost ~40 ms of page faults)."""
        rows = x.reshape(-1, self.k)
        if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < self.k):
            rows = rows.contiguous()
        if out is None:
            y = torch.empty(rows.shape[0], self.n, dtype=self.dtype)
        elif tuple(out.shape) != (rows.shape[0], self.n) or out.dtype != self.dtype or \
                not out.is_contiguous() or out.device.type != "cpu":
            # Checked even here: the kernel writes rows x n values from out's first address.
            raise ValueError(f"out must be a contiguous {self.dtype} CPU tensor of shape "
                             f"[{rows.shape[0]}, {self.n}], got {tuple(out.shape)}, {out.dtype}")
        else:
            y = out
        sync_threads()
        run = _C.linear_bf16 if self.dtype == torch.bfloat16 else _C.linear
        run(rows.data_ptr(), rows.shape[0], self.k, rows.stride(0) if rows.shape[0] > 1 else self.k,
            self.packed.data_ptr(), self.n, 0 if self.bias is None else self.bias.data_ptr(),
            y.data_ptr(), self.n, isa)
        return y.view(*x.shape[:-1], self.n)


def _check_packed(x, packed, bias, n: int) -> int:
    """k of the functional op's arguments; ValueError/TypeError naming the bad one."""
    for name, t in (("x", x), ("packed", packed), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 CPU tensor")
    if x.dim() < 1 or x.shape[-1] == 0 or n <= 0:
        raise ValueError(f"x must be [..., k] with k >= 1 and n >= 1, got shape {tuple(x.shape)}, n={n}")
    k = x.shape[-1]
    if packed.dim() != 1 or packed.shape[0] != _C.linear_packed_floats(n, k) or not packed.is_contiguous():
        raise ValueError(f"packed must be the contiguous 1-D packing of an [{n}, {k}] weight "
                         f"({_C.linear_packed_floats(n, k)} floats), got shape {tuple(packed.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got shape {tuple(bias.shape)}")
    return k


# The functional op over PackedLinear's tensors (`lin.packed`, `lin.bias`), so torch.compile can
# trace a packed linear: y = x @ W.T + bias, the fastest body this CPU has.
@torch.library.custom_op("cb_kernels::linear", mutates_args=())
def _linear_op(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    k = _check_packed(x, packed, bias, n)
    rows = x.reshape(-1, k).contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    sync_threads()
    _C.linear(rows.data_ptr(), rows.shape[0], k, k, packed.data_ptr(), n,
              0 if bias is None else bias.data_ptr(), y.data_ptr(), n, "auto")
    return y.view(*x.shape[:-1], n)


@_linear_op.register_fake
def _(x, packed, bias, n) -> torch.Tensor:
    _check_packed(x, packed, bias, n)
    return x.new_empty(*x.shape[:-1], n)
