"""cb_kernels: fast, dependable continuous batching for Hugging Face transformers models."""
__version__ = "0.1.0"

import os  # noqa: E402

# cb_kernels._C uses the system libgomp, a second OpenMP runtime next to the one torch bundles. With
# the default (active) wait policy each team spins after its parallel regions and steals the cores
# the other needs: measured on 2 cores, SmolLM2 Engine steps ran ~7x slower (24 tokens: 27.4 s vs
# 3.9 s passive). Must be set before _C loads its libgomp; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cb_kernels import models, ops  # noqa: E402
from cb_kernels.engine import Engine, EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["models", "ops", "__version__"]
__all__ += ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
