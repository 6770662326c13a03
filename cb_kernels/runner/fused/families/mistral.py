"""Mistral: Llama's layer with a sliding window read from the config."""
from cb_kernels.runner.fused.spec import FamilySpec

SPECS = [FamilySpec("mistral",
                    sliding_window=lambda attn: getattr(attn.config, "sliding_window", None))]
