"""`cb-kernels generate`: run every prompt of a jsonl file through the Engine.

    cb-kernels generate --model smollm2-135m --input prompts.jsonl --output out.jsonl --chat

Input: one JSON value per line, either a string (the prompt) or an object with one of "prompt"
(text), "messages" (a chat, [{"role": ..., "content": ...}]) or "prompt_token_ids" (ints), and
optionally "id" and any SamplingParams field ("n", "logprobs", "prompt_logprobs", "stop",
"include_stop_str_in_output", "min_new_tokens", "min_p", "repetition_penalty",
"frequency_penalty", "presence_penalty", "logit_bias" (token id -> bias), "temperature", ...),
which overrides the command line's for that line. Output: one object per request, written and
flushed the moment it finishes (so an interrupted run keeps everything finished so far;
`--resume` skips those ids next time): {"id", "index" (input line, from 0), "text",
"token_ids", "finish_reason", "error", "num_prompt_tokens", "stop_reason"}, plus
"logprobs" and "cumulative_logprob" when asked, "prompt_logprobs" when asked, and "outputs"
(one object per sample with index, text, token_ids, finish_reason, stop_reason and the
logprobs) when n > 1. Logprob dicts map token ids (as JSON strings) to logprobs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
                   help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint run its own code")
    e = p.add_argument_group("EngineConfig (default: auto)")
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-blocks", type=int)
    e.add_argument("--max-batch-tokens", type=int)
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--cpu-offload-gib", type=float)
    e.add_argument("--preemption", default="auto", choices=("auto", "swap", "recompute"))
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--attention-backend", default=None)
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


def read_records(path: Path) -> list:
    """[(index, id, record)] of the input; SystemExit naming the line for anything malformed."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"--input {path}, line {n + 1}: not JSON ({e})") from None
            if isinstance(rec, str):
                rec = {"prompt": rec}
            keys = [k for k in ("prompt", "messages", "prompt_token_ids")
                    if isinstance(rec, dict) and k in rec]
            if len(keys) != 1:
                raise SystemExit(f"--input {path}, line {n + 1}: expected a string or an object with exactly "
                                 f"one of 'prompt', 'messages', 'prompt_token_ids'")
            records.append((n, str(rec.get("id", n)), rec))
    ids = [rid for _, rid, _ in records]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"--input {path}: ids must be unique")
    return records


def _prompt_of(rec: dict, tokenizer, chat: bool):
    if "prompt_token_ids" in rec:
        return rec["prompt_token_ids"]
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer, and the checkpoint has none")
    if "messages" in rec:
        return list(tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return rec["prompt"]


def _configs(args):
    from cb_kernels import EngineConfig, SamplingParams

    try:
        config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                              cpu_offload_gib=args.cpu_offload_gib, preemption=args.preemption,
                              prefix_caching=not args.no_prefix_caching,
                              attention_backend=args.attention_backend)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                ignore_eos=args.ignore_eos, n=args.n, logprobs=args.logprobs,
                                prompt_logprobs=args.prompt_logprobs, stop=args.stop,
                                include_stop_str_in_output=args.include_stop_str_in_output,
                                min_new_tokens=args.min_new_tokens, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty,
                                frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"bad option: {e}") from None
    return config, params


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from cb_kernels import Engine
    from cb_kernels.models import load

    config, params = _configs(args)
    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.is_file():
        raise SystemExit(f"--input {in_path} does not exist")
    records = read_records(in_path)
    done = _finished_ids(out_path) if args.resume else set()
    todo = [r for r in records if r[1] not in done]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    model, tokenizer = load(args.model, dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                            trust_remote_code=args.trust_remote_code)
    engine = Engine(model.to(device), config, tokenizer=tokenizer)

    pending = {}   # engine request id -> (index, id)
    written = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a" if args.resume else "w", encoding="utf-8") as out, \
            tqdm(total=len(todo), unit="req", desc="generate", file=sys.stderr) as bar:
        def emit(index, rid, result):
            nonlocal written
            out.write(json.dumps({"id": rid, "index": index, **result}, ensure_ascii=False) + "\n")
            out.flush()
            written += 1
            bar.update(1)

        feed = iter(todo)
        try:
            while True:
                for index, rid, rec in feed if len(pending) < MAX_QUEUED else ():
                    try:
                        p = params_of(rec, params, args.seed, index)
                        pending[engine.add_request(_prompt_of(rec, tokenizer, args.chat), p)] = (index, rid)
                    except (ValueError, TypeError) as e:
                        emit(index, rid, {"text": None, "token_ids": [], "finish_reason": "error",
                                          "error": str(e), "num_prompt_tokens": None})
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
    print(f"{written} results written to {out_path}", file=sys.stderr)
    return 0


def params_of(rec: dict, params, seed, index: int):
    """The SamplingParams of one input line: the command line's, with the line's own sampling
    fields over them (ValueError/TypeError naming the field for a bad one); `--seed S` gives line
    i the seed S + i unless the line sets its own."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(params)}
    fields = {k: v for k, v in rec.items() if k in names}
    if "logit_bias" in fields and isinstance(fields["logit_bias"], dict):
        try:       # JSON object keys are strings
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids, got "
                             f"{list(fields['logit_bias'])[:3]}") from None
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


def _finished_ids(path: Path) -> set:
    """Ids already in `path`; a last line cut by an interruption is dropped (that request reruns)."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    ids = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                continue
    return ids
