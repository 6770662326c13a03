"""Batch generation past one machine, on Ray Data (the `ray` extra: pip install 'cb_kernels[ray]').

    import ray
    from cb_kernels.ray import ProcessorConfig, build_processor

    processor = build_processor(ProcessorConfig(model="smollm2-135m", replicas=4, batch_size=64))
    out = processor(ray.data.read_json("prompts.jsonl"))    # a Dataset of output rows
    out.write_json("results/")

EngineReplica is the stateful callable class under it (one Engine per Ray actor) for users who
write their own `Dataset.map_batches(EngineReplica, **map_batches_args(config))`;
`cb-kernels generate --ray [ADDRESS] --replicas N` runs a jsonl file through it
(cb_kernels.ray.generate). cb_kernels.ray.serve_app serves replicas under Ray Serve.
"""
try:
    import ray  # noqa: F401
    import ray.data  # noqa: F401
except ImportError as e:           # the extra is optional: say which one brings it
    raise ImportError("cb_kernels.ray needs Ray Data: pip install 'cb_kernels[ray]' "
                      f"({e})") from e

from cb_kernels.ray.processor import (ProcessorConfig, build_processor,  # noqa: E402
                                      map_batches_args)
from cb_kernels.ray.replica import EngineReplica  # noqa: E402

__all__ = ["EngineReplica", "ProcessorConfig", "build_processor", "map_batches_args"]
