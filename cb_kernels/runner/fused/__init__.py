"""The fused CPU fp32 decoder forward (forward.py) and the model families it serves, a small spec
each (spec.py, families/)."""
from cb_kernels.runner.fused.forward import FusedForward
from cb_kernels.runner.fused.spec import FamilySpec

__all__ = ["FusedForward", "FamilySpec"]
