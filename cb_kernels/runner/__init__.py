"""Runs a model on the paged KV cache, one engine step at a time (below the engine, above ops).

    base.py                 ModelRunner: the protocol the Engine calls (all it reads); StepOutput
    transformers_runner.py  TransformersRunner: any transformers causal LM (the default runner)
    step_inputs.py          LayerLayout (static, built once); StepInputs / AttentionMetadata: a
                            batch packed and uploaded
    attention.py            our attention function inside transformers' forward; model_lock
    support.py              which models run: UnsupportedModelError and the construction probe
    kv_cache.py             the KV pool tensors (lazily mapped zeros on CPU)
    packed_linears.py       CPU fp32 linears on weights packed once (ours or oneDNN)
    lm_head.py              the LM head chosen once: full logits or the greedy head
    cuda_graphs.py          decode steps replayed as CUDA graphs
    fused/                  the fused CPU fp32 decoder forward and its model-family specs
    tensor_parallel/        the model split over ranks; DriverRunner / FollowerRunner, StepChannel
"""
from cb_kernels.runner.base import ModelRunner, StepOutput
from cb_kernels.runner.step_inputs import AttentionMetadata, StepInputs
from cb_kernels.runner.support import UnsupportedModelError
from cb_kernels.runner.transformers_runner import TransformersRunner

__all__ = ["ModelRunner", "StepOutput", "StepInputs", "AttentionMetadata", "TransformersRunner",
           "UnsupportedModelError"]
