"""What the attention mask of a layer means, found by evaluating transformers' mask function.

transformers builds each layer's mask from a mask function f(batch, head, q_idx, kv_idx) -> bool
(masking_utils: causal, sliding window, chunked, or unions and intersections of those). The
construction probe (probe.py) captures the function each layer gets; `mask_pattern` names
its pattern by evaluating it: at the first 64 positions exhaustively, then by binary search for
the first allowed key of queries up to 2**30 (a window of 4096 keys is found even though the
probe saw 6 tokens).
"""
from __future__ import annotations

import torch


def _allowed(fn, q: int, kv: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.long)
    out = fn(zero, zero, torch.tensor(q, dtype=torch.long), kv)
    return torch.as_tensor(out).to(torch.bool).expand(kv.shape)


def _first_allowed(fn, q: int) -> int:
    """The smallest kv position a query at q attends to (allowed sets are suffixes [lo, q])."""
    lo, hi = 0, q
    while lo < hi:
        mid = (lo + hi) // 2
        if bool(_allowed(fn, q, torch.tensor([mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _grid(fn, n: int) -> torch.Tensor:
    kv = torch.arange(n)
    return torch.stack([_allowed(fn, q, kv) for q in range(n)])


def _without_input_overlays(fn, n: int):
    """`fn` less the parts of an or_masks() union that read the probe's inputs (block or token
    type ids: they cannot be evaluated past the probe) and add no pair there: for text prompts
    such an overlay is empty, and the engine never builds it."""
    parts = None
    if getattr(fn, "__name__", "") == "or_mask" and fn.__closure__:
        for cell in fn.__closure__:
            value = cell.cell_contents
            if isinstance(value, tuple) and all(callable(f) for f in value):
                parts = value
    if not parts:
        return fn
    probe = torch.tensor([n + 1000])
    kept, dropped = [], []
    for part in parts:
        try:
            _allowed(part, n + 1000, probe)
            kept.append(part)
        except (IndexError, RuntimeError):
            dropped.append(part)
    if not dropped or not kept:
        return fn

    def union(b, h, q, kv):
        out = torch.zeros((), dtype=torch.bool)
        for part in kept:
            out = out | torch.as_tensor(part(b, h, q, kv)).to(torch.bool)
        return out

    base = _grid(union, n)
    for part in dropped:
        if bool((_grid(part, n) & ~base).any()):
            return fn
    return union


def mask_pattern(fn, max_positions: int, num_probe_tokens: int):
    """('full', None), ('window', W) or ('chunk', C) for a mask function, else ('other', why)."""
    n = num_probe_tokens
    fn = _without_input_overlays(fn, n)
    try:
        return _pattern(fn, max_positions)
    except (IndexError, RuntimeError) as e:
        return "other", f"its mask function cannot be evaluated past the probe ({e})"


def _pattern(fn, max_positions: int):
    n = 64
    kv = torch.arange(n)
    for q in range(n):
        row = _allowed(fn, q, kv)
        if bool(row[q + 1:].any()):
            return "other", "a query attends to later tokens (bidirectional or prefix-LM mask)"
        idx = torch.nonzero(row[:q + 1]).flatten()
        if idx.numel() == 0 or int(idx[-1]) != q or idx.numel() != q + 1 - int(idx[0]):
            return "other", "the keys a query attends to are not one range ending at itself"
    top = max(n, min(max_positions, 1 << 30) - 1)
    lo_top = _first_allowed(fn, top)
    if lo_top == 0:
        samples = [top // 2, top // 3 + 1, n, 1000]
        if all(_first_allowed(fn, q) == 0 for q in samples if q <= top):
            return "full", None
        return "other", "the allowed keys follow no window or chunk pattern"
    window = top - lo_top + 1
    samples = sorted({q for q in (0, 1, 2, n - 1, n, window - 1, window, window + 1, lo_top - 1,
                                  lo_top, top // 2, top - 1) if 0 <= q <= top})
    if all(_first_allowed(fn, q) == max(0, q - window + 1) for q in samples):
        return "window", window
    chunk = lo_top - _first_allowed(fn, lo_top - 1)
    if chunk > 0 and all(_first_allowed(fn, q) == q // chunk * chunk for q in samples):
        return "chunk", chunk
    return "other", "the allowed keys follow no window or chunk pattern"


def tensor_is_causal(mask: torch.Tensor) -> bool:
    """Whether a dense mask (bool: True attends; float: 0 attends) is plain causal."""
    m = mask[0, 0] if mask.dim() == 4 else mask
    allowed = m if m.dtype == torch.bool else m == 0
    return torch.equal(allowed, torch.ones_like(allowed).tril())
