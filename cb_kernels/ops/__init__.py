"""Public kernel API (see DESIGN.md, "Kernel API"). Each op: validation, backend choice, and a
torch.library custom op; `reference.py` holds the pure-torch oracle of every op."""
from cb_kernels.ops._backend import available_backends
from cb_kernels.ops.paged_attention import paged_attention

__all__ = ["available_backends", "paged_attention"]
