"""build_processor: a `Dataset -> Dataset` callable in the style of ray.data.llm's."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from cb_kernels.ray.replica import EngineReplica


@dataclass
class ProcessorConfig:
    """What build_processor runs: `replicas` Ray actors (num_cpus / num_gpus each), each with an
    Engine of `model` (a built-in name or a checkpoint folder readable on every node) built from
    `engine_config`. `batch_size` is the rows one replica holds at once, and so the most a killed
    replica can cost: its rows are fed as `batches_in_flight` concurrent batches of
    batch_size // batches_in_flight rows (2: the next batch's rows are in the engine, queued,
    while the current one's last rows finish, so continuous batching stays full; 1: one batch
    after another, the engine draining at each batch's end). A killed replica's batches in flight
    are retried on a restarted actor: at most batch_size rows are generated twice.
    engine_config.tensor_parallel_size=N: each replica is N ranks (the actor and N-1 child
    processes, cb_kernels.ray.ranks), num_cpus shared by them (num_cpus // N torch threads each),
    on CUDA one of its num_gpus (>= N) each. The other fields are EngineReplica's."""
    model: str
    engine_config: object = None
    sampling_params: object = None
    dtype: Optional[str] = None
    device: Optional[str] = None
    chat: bool = False
    seed: Optional[int] = None
    trust_remote_code: bool = False
    replicas: int = 1
    batch_size: int = 64
    batches_in_flight: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    settings_fingerprint: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model).strip():
            raise ValueError("model must be a built-in name or a checkpoint folder, got "
                             f"{self.model!r}")
        for name in ("replicas", "batch_size", "batches_in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.batch_size < self.batches_in_flight:
            raise ValueError(f"batch_size must be >= batches_in_flight ({self.batches_in_flight}): "
                             f"a replica holds batch_size rows in all, batches_in_flight batches "
                             f"of batch_size // batches_in_flight rows; got {self.batch_size}")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0 (torch runs on them), got {self.num_cpus!r}")
        if not self.num_gpus >= 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus!r}")
        tp = getattr(self.engine_config, "tensor_parallel_size", 1)
        if tp > 1 and (self.device == "cuda" or self.num_gpus) and self.num_gpus < tp:
            raise ValueError(f"num_gpus must be >= engine_config.tensor_parallel_size={tp} on "
                             f"CUDA (each rank of a replica its own GPU), got {self.num_gpus!r}")
        if self.device == "cuda" and not self.num_gpus:
            raise ValueError("device='cuda' needs num_gpus > 0 (Ray gives an actor no GPU "
                             "otherwise)")

    @property
    def tensor_parallel_size(self) -> int:
        return getattr(self.engine_config, "tensor_parallel_size", 1)

    @property
    def rows_per_call(self) -> int:
        """Rows in one Ray Data batch (one call of a replica): batches_in_flight of them together
        hold at most batch_size rows, the rework bound."""
        return self.batch_size // self.batches_in_flight

    def replica_kwargs(self) -> dict:
        """EngineReplica's constructor arguments."""
        return dict(model=str(self.model), engine_config=self.engine_config,
                    sampling_params=self.sampling_params, dtype=self.dtype,
                    device=self.device or ("cuda" if self.num_gpus else "cpu"), chat=self.chat,
                    seed=self.seed, trust_remote_code=self.trust_remote_code,
                    torch_threads=max(1, int(self.num_cpus) // self.tensor_parallel_size),
                    settings_fingerprint=self.settings_fingerprint)


def build_processor(config: ProcessorConfig, preprocess: Optional[Callable] = None,
                    postprocess: Optional[Callable] = None) -> Callable:
    """A callable `Dataset -> Dataset`: `preprocess` (row -> row, e.g. to build "messages" or
    "prompt_token_ids" from your columns) maps each input row, the replicas generate, and
    `postprocess` (row -> row) maps each output row (EngineReplica's columns). Lazy, as Ray Data
    is: nothing runs until the Dataset is consumed (iterated, written, materialized).

    The rework bound (a killed replica: at most batch_size rows generated twice) holds for
    blocks of at most config.rows_per_call rows: Ray Data gives a task a whole block and retries
    all of it. `cb-kernels generate --ray` makes such blocks; a read_json/read_parquet Dataset
    has blocks of up to 128 MiB: `ds.repartition(target_num_rows_per_block=config.rows_per_call,
    strict=True)` cuts them, in tasks that need a CPU besides the replicas' (on a cluster whose
    every CPU is a replica's, measured here, they never run)."""
    if not isinstance(config, ProcessorConfig):
        raise TypeError(f"config must be a ProcessorConfig, got {type(config).__name__}")
    for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable row -> row, got {type(fn).__name__}")

    def process(dataset):
        if preprocess is not None:
            dataset = dataset.map(preprocess)
        dataset = dataset.map_batches(EngineReplica, **map_batches_args(config))
        if postprocess is not None:
            dataset = dataset.map(postprocess)
        return dataset

    return process


def map_batches_args(config: ProcessorConfig) -> dict:
    """`Dataset.map_batches(EngineReplica, **map_batches_args(config))`'s other arguments: the
    actor pool, each actor's resources, batches of config.rows_per_call rows, and the concurrent
    calls per actor that let the next batch in while the current one runs. Those calls must run
    in threads of their own (enable_true_multi_threading): Ray otherwise serialises an actor's
    calls on one thread, and a call waiting for the engine would keep the next batch out."""
    import ray.data

    k = config.batches_in_flight
    return dict(fn_constructor_kwargs=config.replica_kwargs(), batch_size=config.rows_per_call,
                batch_format="pyarrow", num_cpus=config.num_cpus, num_gpus=config.num_gpus,
                compute=ray.data.ActorPoolStrategy(
                    size=config.replicas, max_tasks_in_flight_per_actor=k,
                    max_concurrent_calls_per_actor=k, enable_true_multi_threading=k > 1))
