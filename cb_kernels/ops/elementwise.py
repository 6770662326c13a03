"""The fused CPU decoder-layer passes in one namespace, for `from cb_kernels.ops.elementwise
import ...`: each op lives in its own module (ops/rms_norm.py, ops/silu_mul.py, ops/rope.py)."""
from cb_kernels.ops.rms_norm import rms_norm, rms_norm_unchecked
from cb_kernels.ops.rope import rope_
from cb_kernels.ops.silu_mul import silu_mul

__all__ = ["rms_norm", "rms_norm_unchecked", "silu_mul", "rope_"]
