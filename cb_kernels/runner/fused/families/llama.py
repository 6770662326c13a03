"""Llama and the families that share its decoder layer exactly (transformers' own classes)."""
from cb_kernels.runner.fused.spec import FamilySpec

SPECS = [FamilySpec("llama")]
