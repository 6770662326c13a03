"""EngineReplica: one Engine per Ray actor, mapping a batch of input rows to output rows.

A row is one line of `cb-kernels generate`'s jsonl input: "prompt" (text), "messages" (a chat) or
"prompt_token_ids", optional "id" and "index" (its position in the job: request `index` samples
with seed + index), and any SamplingParams field, which overrides the replica's for that row. Or
the same line as JSON text in a "record" column: that is how `generate --ray` ships lines whose
fields differ from line to line (Arrow gives every row of a block one schema).

The output row has the columns `generate` writes ("id", "index", "text", "token_ids",
"finish_reason", "error", "num_prompt_tokens") and "output": the whole output line as JSON text,
with "stop_reason", the fingerprints and the logprobs when asked (logprob dicts have a key per
token id, which Arrow would turn into a column per id). Other input columns pass through.
"""
from __future__ import annotations

import functools
import json
import os
import sys

from cb_kernels.generate_cli import (_sha, drop_nulls, error_result, output_record, request_of,
                                     result_of)
from cb_kernels.ray.feed import EngineFeed

# The columns EngineReplica writes; an input column of the same name is replaced.
OUTPUT_COLUMNS = ("id", "index", "text", "token_ids", "finish_reason", "error",
                  "num_prompt_tokens", "output")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


def rows_of(batch) -> list:
    """The rows of a Ray Data batch as plain Python dicts (a null field is None)."""
    import pyarrow as pa

    if not isinstance(batch, pa.Table):
        raise TypeError("map_batches(..., batch_format='pyarrow') is needed: numpy batches turn "
                        f"a missing int into NaN (got a {type(batch).__name__} batch)")
    return batch.to_pylist()


def table_of(batch, columns: dict, types: dict):
    """The output batch: the input's columns except `columns` and "record", then `columns`."""
    import pyarrow as pa

    keep = [n for n in batch.column_names if n not in columns and n != "record"]
    data = {n: batch.column(n) for n in keep}
    data.update({n: pa.array(v, type=types[n]) for n, v in columns.items()})
    return pa.table(data)


def _record_of(row: dict) -> dict:
    if "record" in row:
        rec = json.loads(row["record"])
        return {"prompt": rec} if isinstance(rec, str) else rec
    # Arrow fills a column a row lacks with null: a null field is an absent one.
    return drop_nulls(row)


def _types() -> dict:
    import pyarrow as pa

    return {"id": pa.string(), "index": pa.int64(), "text": pa.string(),
            "token_ids": pa.list_(pa.int64()), "finish_reason": pa.string(),
            "error": pa.string(), "num_prompt_tokens": pa.int64(), "output": pa.string()}


def _lost_rank(error: BaseException) -> bool:
    """Whether `error` comes from a tensor-parallel rank lost (TensorParallelError in its chain)."""
    from cb_kernels.engine.distributed import TensorParallelError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TensorParallelError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _check_ranks(engine) -> None:
    """Raises TensorParallelError once a rank was lost: the engine then fails the rows of every
    step (as error outputs), and none of them is a result."""
    from cb_kernels.engine.distributed import TensorParallelError

    broken = engine.runner.channel.broken      # the TensorParallelRunner contract's channel
    if broken is not None:
        raise TensorParallelError(broken)


def _in_ray_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class EngineReplica:
    """A stateful callable for `ray.data.Dataset.map_batches(EngineReplica, batch_format="pyarrow",
    **cb_kernels.ray.map_batches_args(ProcessorConfig(...)))`: builds one Engine per actor, driven
    by one thread (cb_kernels.ray.feed.EngineFeed). Every call puts its batch's rows into that
    engine and waits for its own; Ray runs `batches_in_flight` calls of the actor at once, so the
    next batch's rows wait in the engine's queue and take the slots the current batch's last rows
    free (continuous batching stays full across batches).

    model: built-in name or checkpoint folder (readable on every node); engine_config:
    EngineConfig; sampling_params: SamplingParams, the default of every row; dtype: as
    cb_kernels.models.load (None: models.fast_dtype's choice for the device); chat: apply the chat
    template to text prompts; seed: row `index` samples with seed + index unless it sets its own;
    torch_threads: torch's intra-op threads in this actor (match the actor's num_cpus);
    settings_fingerprint: written in every output line (`generate --resume` checks it).

    engine_config.tensor_parallel_size=N > 1: this actor is rank 0 and starts the N - 1 other
    ranks as child processes (cb_kernels.ray.ranks; one GPU each on CUDA). A rank lost mid-job
    (TensorParallelError) ends this actor's process after it logs why, so that Ray restarts the
    actor (its ranks rebuilt) and retries its batches; called outside a Ray actor, the batch
    raises that error.
    """

    def __init__(self, model, *, engine_config=None, sampling_params=None, dtype=None,
                 device=None, chat: bool = False, seed=None, trust_remote_code: bool = False,
                 torch_threads: int = 1, settings_fingerprint=None):
        import torch

        from cb_kernels import Engine, EngineConfig, SamplingParams
        from cb_kernels.models import fast_dtype, load

        threads = max(1, int(torch_threads))
        torch.set_num_threads(threads)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        config = engine_config or EngineConfig()
        self.followers = None
        if config.tensor_parallel_size > 1:
            from cb_kernels.engine.distributed import select_device
            from cb_kernels.ray.ranks import Followers

            self.followers = Followers(config.tensor_parallel_size, dict(
                model=str(model), dtype=dtype, device=device, engine_config=config,
                trust_remote_code=trust_remote_code, threads=threads))
            self.followers.join_as_rank0()
            device = select_device(torch.device(device))      # cuda:0 of the actor's GPUs
        try:
            loaded, self.tokenizer = load(model, dtype=dtype,
                                          trust_remote_code=trust_remote_code)
            if dtype is None:
                loaded = loaded.to(fast_dtype(loaded.dtype, device)[0])
            if self.followers is not None:
                self.followers.wait_loaded(config.tensor_parallel_timeout_s)
            self.engine = Engine(loaded.to(device), config, tokenizer=self.tokenizer)
        except BaseException:
            if self.followers is not None:
                self.followers.close()
            raise
        self.params = sampling_params or SamplingParams()
        self.chat, self.seed, self.settings = chat, seed, settings_fingerprint
        self.feed = EngineFeed(self.engine)

    def _request(self, index, rec: dict) -> tuple:
        """Row `rec`'s (prompt, SamplingParams); runs in the feed's thread (the tokenizer's)."""
        if sum(k in rec for k in PROMPT_KEYS) != 1:
            raise ValueError("expected exactly one of " + ", ".join(map(repr, PROMPT_KEYS)))
        return request_of(rec, index, self.params, self.tokenizer, self.chat,
                          self.seed if index is not None else None)

    def __call__(self, batch):
        rows = rows_of(batch)
        records = [_record_of(row) for row in rows]
        try:
            results = self.feed.run([functools.partial(self._request, row.get("index"), rec)
                                     for row, rec in zip(rows, records)])
            if self.followers is not None:
                _check_ranks(self.engine)
        except RuntimeError as e:             # TensorParallelError is one
            if self.followers is not None and _lost_rank(e) and _in_ray_actor():
                print(f"cb_kernels.ray: {e}\nthis replica exits: Ray restarts it (its ranks "
                      "rebuilt) and retries its batches", file=sys.stderr, flush=True)
                self.followers.close()
                os._exit(1)
            raise
        for i, (row, rec, res) in enumerate(zip(rows, records, results)):
            if isinstance(res, Exception):
                index = row.get("index")
                results[i] = error_result(index, res) if index is not None else \
                    {**error_result(0, res), "error": f"id {rec.get('id')}: {res}"}
            else:
                results[i] = result_of(res)
        lines = []
        for row, rec, result in zip(rows, records, results):
            rid = next((v for v in (row.get("id"), rec.get("id"), row.get("index"))
                        if v is not None), None)
            lines.append(output_record(row.get("index"), None if rid is None else str(rid),
                                       result, _sha(rec), self.settings))
        columns = {c: [line[c] for line in lines] for c in OUTPUT_COLUMNS[:-1]}
        columns["output"] = [json.dumps(line, ensure_ascii=False) for line in lines]
        return table_of(batch, columns, _types())
