"""transformers integration: the engine's model adapter (adapter.py) and the drop-in backend for
transformers' own continuous batching (backend.py):

    import cb_kernels.hf
    cb_kernels.hf.enable(model)      # model.generate_batch(...) now runs cb_kernels' paged attention
"""
from cb_kernels.hf.backend import disable, enable, is_enabled

__all__ = ["enable", "disable", "is_enabled"]
