"""cb_kernels: fast, dependable continuous batching for Hugging Face transformers models."""
__version__ = "0.1.0"

from cb_kernels import ops  # noqa: E402
from cb_kernels.engine import Engine, EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["ops", "__version__"]
__all__ += ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
