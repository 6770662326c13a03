"""Tensor parallelism below the engine: a model split over torch.distributed ranks, and the
runners that keep the ranks in step.

    sharding.py   the split of a Llama-style model in place (heads, MLP columns, vocabulary), the
                  collectives as marked hooks, ShardedHead, local_only()
    channel.py    StepChannel: rank 0's messages (a packed step, an RL call, the session's
                  end) and their wire format; TensorParallelError
    runners.py    DriverRunner (rank 0) and FollowerRunner (the others) around each rank's own
                  runner; make_runner picks one (runner/base.TensorParallelRunner: their contract)

engine/distributed.build_runner builds this rank's one over a process group it sets up; pass it
as Engine(model, config, runner=runner) on every rank.
"""
from cb_kernels.runner.tensor_parallel.channel import StepChannel, TensorParallelError
from cb_kernels.runner.tensor_parallel.runners import DriverRunner, FollowerRunner, make_runner
from cb_kernels.runner.tensor_parallel.sharding import (GATHER_SUM_MAX, ShardedHead, TPInfo,
                                                        all_reduce_, check_shardable,
                                                        full_shape, gather_last, info_of,
                                                        is_tp_hook, local_only, shard_model,
                                                        shard_of, size_of)

__all__ = ["StepChannel", "TensorParallelError", "DriverRunner", "FollowerRunner", "make_runner",
           "ShardedHead", "TPInfo", "GATHER_SUM_MAX", "all_reduce_", "check_shardable",
           "full_shape", "gather_last", "info_of", "is_tp_hook", "local_only", "shard_model",
           "shard_of", "size_of"]
