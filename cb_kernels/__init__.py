"""cb_kernels: fast, dependable continuous batching for Hugging Face transformers models."""
__version__ = "0.1.0"

import os  # noqa: E402

# OpenMP's default (active) wait keeps worker threads spinning after every parallel region. On the
# 2-core machines this project is built on, shared with other work, that starved torch's matmuls:
# Engine steps ran ~7x slower (SmolLM2, 24 tokens: 27.4 s active vs 3.9 s passive). _C shares
# torch's libgomp (same soname, loaded first by torch), and libgomp reads this variable once, when
# it loads: it takes effect when cb_kernels is imported before torch (the CLI does), and a user's
# own setting always wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cb_kernels import models, ops  # noqa: E402
from cb_kernels.engine import Engine, EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["models", "ops", "__version__"]
__all__ += ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
