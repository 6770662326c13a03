"""Qwen2 (q/k/v biases, per-layer sliding window) and Qwen3 (plus RMSNorm of q and k)."""
from cb_kernels.runner.fused.spec import FamilySpec


def _window(attn):
    return getattr(attn, "sliding_window", None)


SPECS = [FamilySpec("qwen2", sliding_window=_window),
         FamilySpec("qwen3", qk_norm=True, sliding_window=_window)]
