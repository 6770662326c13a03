"""Runs a model on the paged KV cache, one engine step at a time (below the engine, above ops).

    base.py                 ModelRunner: the protocol the Engine calls (all it reads); StepOutput
    transformers_runner.py  TransformersRunner: any transformers causal LM (the default runner)
    step_inputs.py          LayerLayout (static, built once); StepInputs / AttentionMetadata: a
                            batch packed and uploaded
    attention.py            our attention function inside transformers' forward; model_lock
    forward_context.py      what the hooks inside transformers' forward read for this thread's step
    support.py              which models run: UnsupportedModelError, the static check
    probe.py                the construction probe's recording forward
    attention_layers.py     each attention layer's plan (K/V shape, window, chunk, sinks)
    state_layers.py         stateful layers and their state shapes
    state_cache.py          the state slots (StatePool) and a step's split by sequence (plan)
    state_adapters.py       what a stateful layer reads its state through (per family)
    state_switch.py         the forward patch that runs stateful layers on the slots
    state_carry.py          the construction check of stateful layers on the slots
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
