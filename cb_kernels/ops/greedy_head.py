"""Greedy LM head on CPU: the argmax token of `hidden @ weight.T` without every fp32 logit (fp32
or bf16 weights).

    head = GreedyHead(model.lm_head.weight)      # packs an int8 copy (a quarter of the fp32 size)
    tokens = head(hidden_states)                  # int64 [rows], == (hidden @ W.T).argmax(-1)

Every vocab row is scored with int8 dot products (AVX-512 VNNI: 4x the fp32 FMA rate) together
with a proven bound on the score's distance from the exact logit; the rows whose bound reaches
the best one are candidates, recomputed exactly (fp32 inputs, double sums) largest bound first
until no candidate left can win, and the largest wins, the lowest index on a tie. csrc/cpu/greedy_head.cpp derives the bound. The result is the argmax of
exact logits; it equals torch's argmax of fp32 logits up to fp32 rounding of near-ties, the same
slack as between any two fp32 GEMMs.

The engine uses it on all-greedy CPU steps where `GreedyHead.fast()` (the CPU has VNNI); without
VNNI the portable body gives the same tokens, slower than oneDNN's fp32 head.

A bf16 weight is read as its exact fp32 values and the token is the argmax of the exact logits
rounded to bf16, lowest index on a tie: the rule of argmax over a bf16 GEMM's logits (which the
engine's other steps take), so a greedy request gets the same token whether its step is
all-greedy or not, up to the GEMM's fp32 rounding at a bf16 rounding edge. The exact maximum
would differ: bf16 logits tie often (8 significant bits).
"""
from __future__ import annotations

import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES

# A hidden dim joins the head's exact dims when some row has it above this many times the row's
# RMS (SmolLM2-135M: rows with one dim at 16x; a Gaussian row passes 5x once in ~10^6 dims).
OUTLIER_RATIO = 5.0
MAX_EXACT_DIMS = 8


class GreedyHead:
    """An int8 copy of an fp32 or bf16 CPU head weight [vocab, hidden] and the argmax over it.

    It keeps a reference to `weight` (the exact rescoring reads it) and repacks when the weight
    changes through torch (in-place writes, a new tensor); `refresh(force=True)` repacks after
    writes that torch does not see (`.data`)."""

    def __init__(self, weight: torch.Tensor, max_exact_dims: int = MAX_EXACT_DIMS):
        self._check_weight(weight)
        if isinstance(max_exact_dims, bool) or not isinstance(max_exact_dims, int) \
                or not 0 <= max_exact_dims <= 64:
            raise ValueError(f"max_exact_dims must be an int in [0, 64], got {max_exact_dims!r}")
        self.max_exact_dims = max_exact_dims
        self.weight = weight
        self.vocab, self.hidden = weight.shape
        nbytes, nstats = _C.greedy_head_sizes(self.vocab, self.hidden)
        self.packed = torch.empty(nbytes, dtype=torch.uint8)
        self.row_stats = torch.empty(nstats, dtype=torch.float32)   # scales and norms
        # Outlier dims of the hidden states seen so far, scored in fp32 from these columns.
        self.exact_dims = torch.zeros(max_exact_dims, dtype=torch.int32)
        self.exact_cols = torch.zeros(max_exact_dims, nstats // 4, dtype=torch.float32)
        self.num_exact = 0
        self._outliers = torch.zeros(max(1, max_exact_dims), dtype=torch.int32)   # reported dims
        self.num_rescored = 0       # logits computed exactly by the last call
        self.num_candidates = 0     # vocab rows the int8 bound left in the running, last call
        self.num_fp32_rows = 0      # rows of the last call left to the fp32 product
        # Past this many candidates a row goes to the fp32 product: each rescoring reads a
        # weight row from memory, the product streams the whole weight once (for all such rows).
        # (Candidates are rescored largest bound first and only until none left can win, so
        # most of a long list is never read.)
        self.max_rescored_per_row = max(256, self.vocab // 4)
        self._key = None
        self.num_packs = 0          # int8 copies made (the engine's warm-up test counts them)
        self.refresh()

    @staticmethod
    def fast() -> bool:
        """True where this CPU runs the VNNI body (elsewhere oneDNN's fp32 head is faster)."""
        return bool(_C.greedy_head_has_simd())

    @staticmethod
    def accepts(weight) -> bool:
        """Whether `weight` is one this head can pack (what the constructor checks)."""
        try:
            GreedyHead._check_weight(weight)
        except (TypeError, ValueError):
            return False
        return True

    @staticmethod
    def _check_weight(weight) -> None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
            raise ValueError(f"weight must be a non-empty 2-D [vocab, hidden] tensor, got shape "
                             f"{tuple(weight.shape)}")
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"weight must be fp32 or bf16 on the CPU, got {weight.dtype} on "
                             f"{weight.device}")
        if weight.stride(1) != 1:
            raise ValueError("weight rows must be contiguous (stride(1) == 1)")

    def refresh(self, force: bool = False) -> None:
        w = self.weight
        # Inference tensors have no version counter: their in-place writes cannot be seen.
        key = (w.data_ptr(), 0 if w.is_inference() else w._version)
        if key == self._key and not force:
            return
        self._check_weight(w)              # `.data = other` can change shape, dtype, strides
        if tuple(w.shape) != (self.vocab, self.hidden):
            raise ValueError(f"weight changed shape: packed as [{self.vocab}, {self.hidden}], "
                             f"now {list(w.shape)}; build a new GreedyHead")
        _C.greedy_head_pack(w.data_ptr(), self.vocab, self.hidden, w.stride(0),
                            self.packed.data_ptr(), self.row_stats.data_ptr(), DTYPE_CODES[w.dtype])
        for e in range(self.num_exact):
            self._gather_column(e)
        # Holding the storage packed from keeps its address from being reused by a later
        # `.data = ...` (whose version counter does not move): a new address means a repack.
        self._packed_from = w.untyped_storage()
        self._key = key
        self.num_packs += 1

    def _gather_column(self, e: int) -> None:
        with torch.no_grad():
            self.exact_cols[e, :self.vocab] = self.weight[:, int(self.exact_dims[e])]

    def _add_exact_dims(self, dims: list) -> None:
        """Scores `dims` exactly from the next call on (up to max_exact_dims in all)."""
        known = set(self.exact_dims[:self.num_exact].tolist())
        for d in dims:
            if self.num_exact == self.max_exact_dims:
                break
            if d in known:          # reported by two chunks of rows
                continue
            known.add(d)
            self.exact_dims[self.num_exact] = d
            self._gather_column(self.num_exact)
            self.num_exact += 1

    def __call__(self, hidden_states: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
        """hidden_states: CPU [rows, hidden], fp32 (or bf16, read exactly as fp32). Returns int64
        [rows]. With a bf16 weight the token is the argmax of the exact logits rounded to bf16
        (lowest index on a tie): what argmax of a bf16 GEMM's logits gives, up to the GEMM's fp32
        rounding. Raises RuntimeError on a non-finite hidden state (the caller's fp32 path then
        applies torch's NaN rule). `isa` caps the body (tests): "auto" or one of _C.cpu_isas();
        ValueError otherwise."""
        h = hidden_states
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"hidden_states must be a 2-D [rows, {self.hidden}] tensor, got "
                             f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
        if h.device.type != "cpu" or h.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"hidden_states must be fp32 or bf16 on the CPU, got {h.dtype} on "
                             f"{h.device}")
        if h.dtype == torch.bfloat16:
            h = h.float()
        if h.stride(1) != 1 or (h.shape[0] > 1 and h.stride(0) < h.shape[1]):
            h = h.contiguous()
        self.refresh()
        out = torch.empty(h.shape[0], dtype=torch.int64)
        w = self.weight
        room = self.max_exact_dims - self.num_exact
        self.num_rescored, found, self.num_candidates = _C.greedy_head(
            h.data_ptr(), h.shape[0], h.stride(0) if h.shape[0] > 1 else self.hidden,
            self.packed.data_ptr(), self.row_stats.data_ptr(),
            w.data_ptr(), self.vocab, self.hidden, w.stride(0), self.exact_dims.data_ptr(),
            self.exact_cols.data_ptr(), self.num_exact, out.data_ptr(),
            self.max_rescored_per_row, OUTLIER_RATIO if room else 0.0,
            self._outliers.data_ptr(), room, isa, DTYPE_CODES[w.dtype])
        if found:           # exact from the next call on (this one's result is exact anyway)
            self._add_exact_dims(self._outliers[:found].tolist())
        wide = (out < 0).nonzero().flatten()
        self.num_fp32_rows = len(wide)
        if len(wide):
            # Rows whose bound admits too many candidates (flat logits, huge outliers): one fp32
            # product is cheaper than that many exact rescorings; argmax keeps the first max.
            with torch.inference_mode(False), torch.no_grad():
                logits = h.index_select(0, wide).to(w.dtype) @ w.detach().t()
            out[wide] = logits.argmax(dim=-1)
        return out

