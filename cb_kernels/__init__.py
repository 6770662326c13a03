"""cb_kernels: fast, dependable continuous batching for Hugging Face transformers models."""
__version__ = "0.1.0"

import os  # noqa: E402

# How long an OpenMP worker spins after a parallel region before it sleeps. A decode step is a
# chain of short parallel regions (one per linear and kernel, a few us apart): a worker that
# sleeps at once (OMP_WAIT_POLICY=PASSIVE) must be woken for each of them, and one that spins
# without end (ACTIVE) starves other work on a shared machine (measured before: Engine steps ~7x
# slower on the 2-core box shared with other jobs). A bounded spin keeps the workers awake across
# one step's regions and lets them sleep between bursts. Measured on the 2-core bench machine, 2
# threads, one decode forward: tiny Llama (32 rows) 11.3 ms passive, 8.1 ms at 2,000 spins, 7.2 ms
# at 20,000; SmolLM2-135M (16 rows) 78 / 53 / 50 ms. libgomp (_C shares torch's, same soname)
# reads this once, when it loads, so it takes effect when cb_kernels is imported before torch (the
# CLI does); a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from cb_kernels import models, ops  # noqa: E402
from cb_kernels.engine import Engine, EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["models", "ops", "__version__"]
__all__ += ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
