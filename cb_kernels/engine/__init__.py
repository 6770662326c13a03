"""The continuous-batching engine: Engine, Scheduler, BlockManager (pure-Python state machines;
the torch work goes through cb_kernels.ops and cb_kernels.hf.adapter)."""
from cb_kernels.engine.config import EngineConfig, RequestMetrics, RequestOutput, SamplingParams
from cb_kernels.engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics"]
