"""`cb-kernels generate --ray [ADDRESS] --replicas N`: the generate command on a Ray cluster.

The driver (this process) reads and checks --input and, with --resume, --output exactly as the
single-engine command does, before any model loads; the rows still to run become a Ray Dataset
(one line per row, as JSON text: lines differ in their fields); `--replicas` EngineReplica actors
generate; the driver writes each output line the moment its batch comes back, flushed, keyed by
id. A replica holds at most --ray-batch-size rows (--ray-batches-in-flight batches of
--ray-batch-size // --ray-batches-in-flight rows, in blocks of that size); a batch whose actor died
is retried by Ray Data on a restarted actor (max_restarts=-1 and task retries are its defaults for
actor pools), so a killed replica costs at most --ray-batch-size rows of rework; the driver skips
an id it has already written, so a retried batch never duplicates a line.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from cb_kernels.generate_cli import prepare_job
from cb_kernels.ray.processor import ProcessorConfig, build_processor


def _blocks_of(rows: list, size: int):
    """A Dataset of `rows` in blocks of exactly `size` rows (the last one fewer): Ray Data retries
    a task's whole input, and a task takes whole blocks, so this bounds a killed replica's rework
    (ProcessorConfig.rows_per_call)."""
    import pyarrow as pa
    import ray

    schema = pa.schema([("id", pa.string()), ("index", pa.int64()), ("record", pa.string())])
    return ray.data.from_arrow([pa.Table.from_pylist(rows[i:i + size], schema=schema)
                                for i in range(0, len(rows), size)])


def _output_batches(dataset):
    """The output blocks as the replicas finish them (a seam the tests wrap)."""
    return dataset.iter_batches(batch_size=None, batch_format="numpy")


# ProcessorConfig's fields as the flags that set them (its errors name the field first).
_FLAGS = {"replicas": "--replicas", "batch_size": "--ray-batch-size",
          "batches_in_flight": "--ray-batches-in-flight",
          "num_cpus": "--cpus-per-replica", "num_gpus": "--gpus-per-replica"}


def _processor_config(args, config, params) -> ProcessorConfig:
    try:
        return ProcessorConfig(
            model=args.model, engine_config=config, sampling_params=params, dtype=args.dtype,
            device=args.device, chat=args.chat, seed=args.seed,
            trust_remote_code=args.trust_remote_code,
            replicas=1 if args.replicas is None else args.replicas,
            batch_size=args.ray_batch_size, batches_in_flight=args.ray_batches_in_flight,
            num_cpus=args.cpus_per_replica,
            num_gpus=args.gpus_per_replica)
    except (ValueError, TypeError) as e:
        field, _, rest = str(e).partition(" ")
        raise SystemExit(f"--ray: {_FLAGS.get(field, field)} {rest}") from None


def _init_ray(address: str) -> bool:
    """Connects to ADDRESS (or starts a local cluster); True when this call started Ray."""
    import ray

    if ray.is_initialized():          # a caller (a notebook, the tests) already connected
        return False
    try:
        ray.init(address=address or None, log_to_driver=True)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise SystemExit(f"--ray {address}: cannot connect to the Ray cluster ({e})") from None
    return True


def _reason(error: BaseException) -> str:
    """The last line of the innermost error Ray wraps (the replica's own exception)."""
    while getattr(error, "cause", None) is not None and error.cause is not error:
        error = error.cause
    lines = [x for x in str(error).strip().splitlines() if x.strip()]
    return lines[-1] if lines else type(error).__name__


def run_on_ray(args, config, params) -> int:
    import ray
    from tqdm import tqdm

    device = args.device or ("cuda" if args.gpus_per_replica > 0 else "cpu")
    checked = _processor_config(args, config, params)    # bad flags fail before the input is read
    job = prepare_job(args, device)
    processor = build_processor(replace(checked, settings_fingerprint=job.settings))
    started = _init_ray(args.ray) if job.todo else False
    written, seen = 0, set()
    t0 = time.perf_counter()
    mode = "a" if args.resume else "w"
    try:
        with open(job.out_path, mode, encoding="utf-8") as out, \
                tqdm(total=len(job.todo), unit="req", file=sys.stderr,
                     desc=f"generate (ray, {checked.replicas} replicas)") as bar:
            if not job.todo:
                return _done(0, job.out_path)
            rows = [{"id": rid, "index": index, "record": json.dumps(rec, ensure_ascii=False)}
                    for index, rid, rec in job.todo]
            dataset = processor(_blocks_of(rows, checked.rows_per_call))
            try:
                for batch in _output_batches(dataset):
                    fresh = [(rid, line) for rid, line in zip(batch["id"], batch["output"])
                             if rid not in seen]
                    for rid, line in fresh:
                        out.write(line + "\n")
                        seen.add(rid)
                    out.flush()
                    written += len(fresh)
                    bar.update(len(fresh))
            except KeyboardInterrupt:
                bar.close()
                print(f"\ninterrupted: {written} results kept in {job.out_path}; rerun with "
                      "--resume to finish", file=sys.stderr)
                return 130
            except ray.exceptions.RayError as e:
                raise SystemExit(f"--ray: the job failed after {written} results "
                                 f"({time.perf_counter() - t0:.0f} s): {_reason(e)}") from None
    finally:
        if started:
            ray.shutdown()
    return _done(written, job.out_path)


def _done(written: int, path) -> int:
    print(f"{written} results written to {path}", file=sys.stderr)
    return 0
