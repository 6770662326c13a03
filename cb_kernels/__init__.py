"""cb_kernels: fast, dependable continuous batching for Hugging Face transformers models."""
__version__ = "0.1.0"

import os  # noqa: E402

# How long an OpenMP worker spins after a parallel region before it sleeps. A decode step is a
# chain of short parallel regions (one per linear and kernel, a few us apart): a worker that
# sleeps at once (OMP_WAIT_POLICY=PASSIVE) must be woken for each of them, and one that spins
# long (ACTIVE, or libgomp's default 300,000 spins) starves other work when a core is shared and
# is then itself scheduled late. Measured on the 2-core bench machine, tiny Llama, 2 threads:
#   one decode forward, machine idle:          passive 11.3 ms, 2,000 spins 8.1, 20,000 spins 7.2
#   one engine step, one core busy elsewhere:  passive 13.4 ms, 2,000 spins 14.8, 20,000 spins 34.5
# (SmolLM2-135M decode forward, idle: 78 / 53 / 50 ms). 2,000 keeps most of the gain and little
# of the risk. libgomp (_C shares torch's, same soname) reads this once, when it loads, so it takes
# effect when cb_kernels is imported before torch (the CLI and the benches do); a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

import importlib  # noqa: E402

# Public names, imported on first use: `import cb_kernels.ops` loads the kernels and torch, no
# engine, runner or transformers (tests/test_foundation.py checks it).
_LAZY = {"models": "cb_kernels.models", "ops": "cb_kernels.ops",
         "Engine": "cb_kernels.engine", "EngineConfig": "cb_kernels.engine",
         "SamplingParams": "cb_kernels.engine", "RequestOutput": "cb_kernels.engine",
         "CompletionOutput": "cb_kernels.engine", "StructuredOutput": "cb_kernels.engine",
         "UnsupportedModelError": "cb_kernels.runner.support"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'cb_kernels' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if _LAZY[name] == f"cb_kernels.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
