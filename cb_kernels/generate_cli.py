"""`cb-kernels generate`: run every prompt of a jsonl file through the Engine.

    cb-kernels generate --model smollm2-135m --input prompts.jsonl --output out.jsonl --chat

Input: one JSON value per UTF-8 line, either a string (the prompt) or an object with one of
"prompt" (text), "messages" (a chat, [{"role": ..., "content": ...}]) or "prompt_token_ids"
(ints), and optionally "id" and any SamplingParams field ("n", "logprobs", "prompt_logprobs",
"stop", "include_stop_str_in_output", "min_new_tokens", "min_p", "repetition_penalty",
"frequency_penalty", "presence_penalty", "logit_bias" (token id -> bias), "temperature", ...),
which overrides the command line's for that line. A file that is not UTF-8 JSON lines, has a
line without a prompt or repeats an id is refused (naming the line) before the model loads; a
line whose prompt or sampling fields are unusable (token ids that are not ints, messages the
chat template cannot render, too long, a bad sampling value) becomes an error record and every
other line runs.

Output: one object per request, written and flushed the moment it finishes (so an interrupted
run keeps everything finished so far; `--resume` skips those ids next time): {"id", "index"
(input line, from 0), "text", "token_ids", "finish_reason", "error", "num_prompt_tokens",
"stop_reason", "input_fingerprint", "settings_fingerprint"}, plus "logprobs" and
"cumulative_logprob" when asked, "prompt_logprobs" when asked, and "outputs" (one object per
sample with index, text, token_ids, finish_reason, stop_reason and the logprobs) when n > 1.
Logprob dicts map token ids (as JSON strings) to logprobs. The fingerprints (sha256 prefixes of
the input record and of the options that change results: model, dtype, --chat, sampling) let
`--resume` refuse an output made from another input or with other settings instead of mixing
them.

`--ray [ADDRESS] --replicas N` runs the same job on a Ray cluster (cb_kernels.ray.generate, the
`ray` extra) with the same input checks and output lines.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import NamedTuple

# Requests queued in the engine at once: enough to keep every batch full, few enough that a
# million-line file does not sit in memory as token ids.
MAX_QUEUED = 1024


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m) or checkpoint folder")
    p.add_argument("--input", required=True, help="jsonl file of prompts")
    p.add_argument("--output", required=True, help="jsonl file of results (overwritten unless --resume)")
    p.add_argument("--resume", action="store_true", help="append to --output, skipping ids already there")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to text prompts")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: the fastest here for the checkpoint, "
                        "cb_kernels.models.fast_dtype: bfloat16 on CUDA and on CPUs with "
                        "AVX512-BF16 or AMX, else float32)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint run its own code")
    add_engine_args(p)
    ray = p.add_argument_group("Ray (the `ray` extra; cb_kernels.ray)")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="run on a Ray cluster (ray.init(ADDRESS); none: a local cluster)")
    ray.add_argument("--replicas", type=int, default=None, help="engines (Ray actors); default 1")
    ray.add_argument("--ray-batch-size", type=int, default=64,
                     help="rows a replica holds at once: the most a killed replica costs")
    ray.add_argument("--ray-batches-in-flight", type=int, default=2,
                     help="Ray Data batches those rows come in (1: one after another)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0)
    ray.add_argument("--gpus-per-replica", type=float, default=0.0)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N processes (torch.distributed; started here "
                        "unless run under torchrun)")
    s = p.add_argument_group("SamplingParams")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None, help="request i samples with seed + i")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    s.add_argument("--prompt-logprobs", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--include-stop-str-in-output", action="store_true")
    s.add_argument("--min-new-tokens", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The EngineConfig flags (`cb-kernels serve` has them too); engine_config(args) reads them."""
    e = p.add_argument_group("EngineConfig (default: auto)")
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-blocks", type=int)
    e.add_argument("--max-batch-tokens", type=int)
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--cpu-offload-gib", type=float)
    e.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"))
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--attention-backend", default=None)


# Options that cannot change a result (how the engine schedules, where files go): left out of
# the settings fingerprint. Every other option, including ones added later, is in it.
_NOT_IN_FINGERPRINT = frozenset({
    "fn", "command", "input", "output", "resume", "device", "trust_remote_code", "block_size",
    "num_blocks", "max_batch_tokens", "max_num_seqs", "cpu_offload_gib", "preemption",
    "no_prefix_caching", "attention_backend", "tensor_parallel_size", "ray", "replicas",
    "ray_batch_size", "ray_batches_in_flight", "cpus_per_replica", "gpus_per_replica"})


def _sha(value) -> str:
    data = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:16]


def settings_fingerprint(args: argparse.Namespace, device: str) -> str:
    """Of every option that can change a result (the --dtype option as given; without it the dtype
    follows the device and, on CPU, whether it has native bf16: both are in it too)."""
    from cb_kernels.models import native_bf16

    settings = {k: v for k, v in vars(args).items() if k not in _NOT_IN_FINGERPRINT}
    model = Path(args.model).expanduser()
    settings.update(model=str(model.resolve()) if model.is_dir() else args.model.lower(),
                    device=device)
    if args.dtype is None and device == "cpu":      # models.fast_dtype's choice depends on it
        settings["native_bf16"] = native_bf16()
    return _sha(settings)


def read_records(path: Path) -> list:
    """[(index, id, record)] of the input (jsonl, or parquet: one row per line); SystemExit naming
    the line for anything malformed."""
    records = []
    for n, rec in _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path):
        if isinstance(rec, str):
            rec = {"prompt": rec}
        keys = [k for k in ("prompt", "messages", "prompt_token_ids")
                if isinstance(rec, dict) and k in rec]
        if len(keys) != 1:
            raise SystemExit(f"--input {path}, line {n + 1}: expected a string or an object with exactly "
                             f"one of 'prompt', 'messages', 'prompt_token_ids'")
        records.append((n, str(rec.get("id", n)), rec))
    first_line = {}
    for n, rid, _ in records:
        if rid in first_line:
            raise SystemExit(f"--input {path}: ids must be unique; id {rid!r} is on lines "
                             f"{first_line[rid] + 1} and {n + 1}")
        first_line[rid] = n
    return records


def _jsonl_rows(path: Path):
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(f"--input {path}, line {n + 1}: not UTF-8 ({e.reason} at byte "
                                 f"{e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise SystemExit(f"--input {path}, line {n + 1}: not JSON ({e})") from None


def _parquet_rows(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"--input {path}: reading parquet needs pyarrow (pip install pyarrow, "
                         "or the ray extra)") from None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise SystemExit(f"--input {path}: not a readable parquet file ({e})") from None
    for n, row in enumerate(table.to_pylist()):
        yield n, drop_nulls(row)


def drop_nulls(value):
    """A row from Arrow as the jsonl line it stands for: Arrow gives a row every column of its
    table, and a struct (a chat message, a logit_bias map) every key of its column, null where
    the row has none; those fields are dropped."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def _render_chat(tokenizer, messages) -> list:
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("'messages' must be a non-empty list of objects with a 'role' and a "
                         f"'content', got {json.dumps(messages)[:80]}")
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    except Exception as e:   # jinja2's UndefinedError, TemplateError, ... from the template
        raise ValueError(f"the chat template cannot render 'messages' ({type(e).__name__}: "
                         f"{e})") from None


def prompt_of(rec: dict, tokenizer, chat: bool):
    if "prompt_token_ids" in rec:
        ids = rec["prompt_token_ids"]
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                            for t in ids):
            raise ValueError("'prompt_token_ids' must be a list of ints, got "
                             f"{json.dumps(ids)[:80]}")
        return ids
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer, and the checkpoint has none")
    if "messages" in rec:
        return _render_chat(tokenizer, rec["messages"])
    if not isinstance(rec["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {json.dumps(rec['prompt'])[:80]}")
    if chat:
        return _render_chat(tokenizer, [{"role": "user", "content": rec["prompt"]}])
    return rec["prompt"]


def _check_output(path: Path) -> None:
    """SystemExit unless `path` can be written (checked before the model loads)."""
    if path.is_dir():
        raise SystemExit(f"--output {path} is a directory; give the path of a file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SystemExit(f"--output {path} is under {parent}, which is a file")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        open(path, "a", encoding="utf-8").close()
    except OSError as e:
        raise SystemExit(f"--output {path} cannot be written ({e.strerror or e})") from None


def engine_config(args):
    """The EngineConfig of the add_engine_args flags (ValueError/TypeError for a bad one)."""
    from cb_kernels import EngineConfig

    return EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                        cpu_offload_gib=args.cpu_offload_gib, preemption=args.preemption,
                        prefix_caching=not args.no_prefix_caching,
                        attention_backend=args.attention_backend,
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def _configs(args):
    try:
        return engine_config(args), sampling_params(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"bad option: {e}") from None


def sampling_params(args):
    """The SamplingParams of the command line (ValueError/TypeError for a bad one)."""
    from cb_kernels import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          ignore_eos=args.ignore_eos, n=args.n, logprobs=args.logprobs,
                          prompt_logprobs=args.prompt_logprobs, stop=args.stop,
                          include_stop_str_in_output=args.include_stop_str_in_output,
                          min_new_tokens=args.min_new_tokens, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty)


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from cb_kernels import Engine
    from cb_kernels.models import fast_dtype, load

    config, params = _configs(args)
    if args.ray is not None:
        from cb_kernels.ray.generate import run_on_ray

        return run_on_ray(args, config, params)
    if args.replicas is not None:
        raise SystemExit("--replicas needs --ray (replicas are Ray actors)")
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
        torch.distributed.is_initialized() else 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    job = prepare_job(args, device)
    out_path, todo, inputs, settings = job.out_path, job.todo, job.inputs, job.settings
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if config.tensor_parallel_size > 1 and not _in_process_group():
        # Every check above passed here: the N ranks start (each runs this function again).
        from cb_kernels.engine.launcher import spawn

        if device == "cuda":
            raise SystemExit("--tensor-parallel-size on CUDA: run under torchrun "
                             f"--nproc-per-node {config.tensor_parallel_size} (one GPU per rank)")
        import torch.multiprocessing as mp

        try:
            spawn(_tp_rank, config.tensor_parallel_size, (args,),
                  timeout_s=config.tensor_parallel_timeout_s)
        except mp.ProcessRaisedException as e:      # its text ends with the rank's error line
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            raise SystemExit(f"--tensor-parallel-size {config.tensor_parallel_size}: rank "
                             f"{e.error_index} failed: {lines[-1] if lines else e}") from None
        except mp.ProcessExitedException as e:
            raise SystemExit(f"--tensor-parallel-size {config.tensor_parallel_size}: {e}") \
                from None
        return 0
    if config.tensor_parallel_size > 1:      # each rank its own GPU, before the model moves
        from cb_kernels.engine.distributed import select_device

        device = select_device(torch.device(device))
    model, tokenizer = load(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    if args.dtype is None:
        dtype, why = fast_dtype(model.dtype, device)
        if rank == 0:
            print(f"dtype: {str(dtype).replace('torch.', '')} ({why})", file=sys.stderr)
        model = model.to(dtype)
    engine = Engine(model.to(device), config, tokenizer=tokenizer)
    if engine.rank != 0:
        engine.follow()             # rank 0 reads the input and writes the output
        return 0

    pending = {}   # engine request id -> (index, id)
    written = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a" if args.resume else "w", encoding="utf-8") as out, \
            tqdm(total=len(todo), unit="req", desc="generate", file=sys.stderr) as bar:
        def emit(index, rid, result):
            nonlocal written
            out.write(json.dumps(output_record(index, rid, result, inputs[rid][1], settings),
                                 ensure_ascii=False) + "\n")
            out.flush()
            written += 1
            bar.update(1)

        feed = iter(todo)
        try:
            while True:
                for index, rid, rec in feed if len(pending) < MAX_QUEUED else ():
                    try:
                        prompt, p = request_of(rec, index, params, tokenizer, args.chat, args.seed)
                        pending[engine.add_request(prompt, p)] = (index, rid)
                    except (ValueError, TypeError) as e:
                        emit(index, rid, error_result(index, e))
                    if len(pending) >= MAX_QUEUED:
                        break
                if not engine.has_unfinished():
                    break
                for o in engine.step():
                    index, rid = pending.pop(o.request_id)
                    emit(index, rid, result_of(o))
        except KeyboardInterrupt:
            bar.close()
            print(f"\ninterrupted: {written} results kept in {out_path}; rerun with --resume to finish",
                  file=sys.stderr)
            return 130
        finally:
            engine.release()             # the other ranks' follow() returns
    print(f"{written} results written to {out_path}", file=sys.stderr)
    return 0


class Job(NamedTuple):
    """A checked `generate` job: the input's records, those still to run (not in the output
    when resuming), id -> (index, input fingerprint), the settings fingerprint, the output path."""
    records: list
    todo: list
    inputs: dict
    settings: str
    out_path: Path


def prepare_job(args: argparse.Namespace, device: str) -> Job:
    """Reads and checks --input, --output and (with --resume) what the output already holds;
    SystemExit naming the problem. Runs before any model loads."""
    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.is_file():
        raise SystemExit(f"--input {in_path} does not exist")
    if out_path.suffix == ".parquet":
        raise SystemExit(f"--output {out_path}: results are written as jsonl (one line the moment "
                         "each finishes, which --resume needs); convert afterwards, e.g. "
                         "pyarrow.json.read_json(...) then pyarrow.parquet.write_table(...)")
    records = read_records(in_path)
    settings = settings_fingerprint(args, device)
    inputs = {rid: (index, _sha(rec)) for index, rid, rec in records}
    done = _finished_ids(out_path, inputs, settings) if args.resume else set()
    _check_output(out_path)
    return Job(records, [r for r in records if r[1] not in done], inputs, settings, out_path)


def request_of(rec: dict, index: int, params, tokenizer, chat: bool, seed) -> tuple:
    """(prompt, SamplingParams) of input line `index`; ValueError/TypeError naming the problem."""
    return prompt_of(rec, tokenizer, chat), params_of(rec, params, seed, index)


def error_result(index: int, error: Exception) -> dict:
    """The result of a line that could not run (its output record says why)."""
    return {"text": None, "token_ids": [], "finish_reason": "error",
            "error": f"line {index + 1}: {error}", "num_prompt_tokens": None}


def output_record(index: int, rid: str, result: dict, input_fingerprint: str, settings: str) -> dict:
    """One line of --output: the id and input line, the result, the two fingerprints."""
    return {"id": rid, "index": index, **result, "input_fingerprint": input_fingerprint,
            "settings_fingerprint": settings}


def _in_process_group() -> bool:
    import os

    import torch

    return (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _tp_rank(rank: int, args: argparse.Namespace) -> None:
    """One rank of `generate --tensor-parallel-size N` started by this command."""
    code = run_generate(args)
    if code:
        raise SystemExit(code)


def params_of(rec: dict, params, seed, index: int):
    """The SamplingParams of one input line: the command line's, with the line's own sampling
    fields over them (ValueError/TypeError naming the field for a bad one); `--seed S` gives line
    i the seed S + i unless the line sets its own."""
    import dataclasses

    from cb_kernels.engine.config import parse_logit_bias

    names = {f.name for f in dataclasses.fields(params)}
    fields = {k: v for k, v in rec.items() if k in names}
    if "logit_bias" in fields:     # JSON object keys are strings
        fields["logit_bias"] = parse_logit_bias(fields["logit_bias"])
    if "stop_token_ids" in fields and isinstance(fields["stop_token_ids"], list):
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    if seed is not None and "seed" not in fields:
        fields["seed"] = seed + index
    return dataclasses.replace(params, **fields) if fields else params


def result_of(o) -> dict:
    """The output line of a finished RequestOutput (the sampling extras only when asked)."""
    first = o.outputs[0]
    result = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
              "error": o.error, "num_prompt_tokens": len(o.prompt_token_ids),
              "stop_reason": first.stop_reason}
    if first.logprobs is not None:
        result["logprobs"], result["cumulative_logprob"] = first.logprobs, first.cumulative_logprob
    if o.prompt_logprobs is not None:
        result["prompt_logprobs"] = o.prompt_logprobs
    if len(o.outputs) > 1:
        result["outputs"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              **({"logprobs": c.logprobs, "cumulative_logprob":
                                  c.cumulative_logprob} if c.logprobs is not None else {})}
                             for c in o.outputs]
    return result


def _finished_ids(path: Path, inputs: dict, settings: str) -> set:
    """Ids already in `path`; a last line cut by an interruption is dropped (that request reruns).
    `inputs`: id -> (index, input fingerprint) of the input now. SystemExit when `path` was made
    from another input or with other settings."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    ids = set()
    redo = "; rerun without --resume (or with another --output) to start over"
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                rid = str(rec["id"])
            except (ValueError, KeyError, TypeError):
                continue
            if "settings_fingerprint" not in rec:
                raise SystemExit(f"--resume: {path} has results without fingerprints (written by "
                                 f"an older cb-kernels), so they cannot be matched to --input{redo}")
            if rec["settings_fingerprint"] != settings:
                raise SystemExit(f"--resume: {path} was made with other settings (model, dtype, "
                                 f"--chat or sampling options){redo}")
            if rid not in inputs:
                raise SystemExit(f"--resume: {path} holds id {rid!r}, which --input does not have:"
                                 f" it was made from another input{redo}")
            index, fingerprint = inputs[rid]
            if rec.get("input_fingerprint") != fingerprint or rec.get("index") != index:
                raise SystemExit(f"--resume: id {rid!r} (--input line {index + 1}) is not the "
                                 f"prompt {path} has a result for (changed or moved since){redo}")
            ids.add(rid)
    return ids
