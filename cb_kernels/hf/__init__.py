"""The drop-in for transformers' own continuous batching (dropin.py):

    import cb_kernels.hf
    cb_kernels.hf.enable(model)      # model.generate_batch(...) now runs cb_kernels' paged attention
"""
from cb_kernels.hf.dropin import disable, enable, is_enabled

__all__ = ["enable", "disable", "is_enabled"]
