"""Models and prompt sets for bench/bench_engine.py.

Models: a random tiny Llama (hidden 256, 4 layers, 8/2 heads, MLP 1024, vocab 32000),
SmolLM2-135M-Instruct (cb_kernels.models.load("smollm2-135m"), fp32), and a random Llama of the
Llama-3.2-1B shape (LLAMA_1B: hidden 2048, 16 layers, 32/8 heads x 64, MLP 8192, vocab 128256,
tied head) whose bf16 weights are written once as a safetensors checkpoint under
~/.cache/cb_kernels (`llama_1b_checkpoint`) and loaded from there by every later run, vLLM-CPU's
included. Three workloads:
  mixed  N requests, prompts uniform in 16..512 tokens, outputs 16..256 (tiny Llama only)
  fixed  32 prompts spread evenly over 16..128 tokens, 64 output tokens each (tiny Llama; equal
         outputs and similar prompts, so padding wastes little and only a cheaper step wins)
  chat   the bundled demo questions (cb_kernels/data/demo_prompts.json) in the model's chat
         template, 64 output tokens each (SmolLM2: the first 16 prompts, 609 prompt tokens)
EOS is switched off on every model so that each contender produces exactly the requested tokens.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from importlib import resources

import torch

TINY_LLAMA = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                  max_position_embeddings=2048)
# Llama-3.2-1B's shape (its config.json; rotary scaling left out: positions here stay < 2048).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=True,
                rms_norm_eps=1e-5)
MODELS = ("tiny-llama", "smollm2-135m", "llama-1b")
WORKLOADS = ("mixed", "fixed", "chat")


def _no_eos(model, pad_id: int):
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id
    return model


def build_tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attn_implementation="sdpa")).eval()
    return _no_eos(model, 0)


def llama_1b_checkpoint(seed: int = 0) -> str:
    """The folder of the random Llama-3.2-1B-shape checkpoint (bf16 safetensors), written on the
    first call (transformers' initialisation in bf16, ~1 min on 2 cores) and reused after."""
    from cb_kernels.models import default_cache_dir

    path = default_cache_dir() / f"bench-llama-1b-shape-bf16-seed{seed}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return str(path)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_1B, attn_implementation="sdpa", eos_token_id=None,
                         bos_token_id=1, pad_token_id=0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(old)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)          # a run killed mid-write leaves no half checkpoint behind
    return str(path)


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """(model in `dtype`, tokenizer or None, checkpoint dir for vLLM or None when it must be
    saved first)."""
    if name == "tiny-llama":
        return build_tiny_llama(), None, None
    if name == "llama-1b":
        from transformers import LlamaForCausalLM

        path = llama_1b_checkpoint()
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
        # vLLM gets the bf16 checkpoint: for an fp32 comparison it casts it as we do.
        return _no_eos(model, 0), None, path
    if name == "smollm2-135m":
        from cb_kernels.models import default_cache_dir, load

        model, tokenizer = load(name, dtype=torch.float32)
        return _no_eos(model.to(dtype), 0), tokenizer, str(default_cache_dir() / name)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def checkpoint_dir(model, saved_dir, stack):
    """A local safetensors checkpoint of `model` for vLLM: `saved_dir`, or a temporary copy
    (removed when `stack`, a contextlib.ExitStack, closes)."""
    if saved_dir is not None:
        return saved_dir
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cbk_bench_"))
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp


def chat_tokenizer():
    """SmolLM2's tokenizer (the chat workload's prompts for a model without one: the 1B shape's
    random weights read them as any token ids below its vocabulary)."""
    from transformers import AutoTokenizer

    from cb_kernels.models import default_cache_dir, ensure_builtin

    return AutoTokenizer.from_pretrained(ensure_builtin("smollm2-135m", default_cache_dir()))


def chat_prompts(tokenizer, n: int) -> list:
    questions = json.loads(resources.files("cb_kernels").joinpath("data/demo_prompts.json")
                           .read_text())
    if n > len(questions):
        raise ValueError(f"the chat workload has {len(questions)} distinct questions, asked for {n}")
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": questions[i]}]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)))
    return out


def workload(kind: str, n: int | None, quick: bool, vocab_size: int, tokenizer=None,
             seed: int = 0):
    """(prompts: list of token-id lists, outputs: one max_new_tokens per prompt)."""
    if kind == "mixed":
        n = n or (16 if quick else 64)
        prompt_range, output_range = ((16, 128), (16, 64)) if quick else ((16, 512), (16, 256))
        rng = random.Random(seed)
        prompts = [[rng.randrange(1, vocab_size) for _ in range(rng.randint(*prompt_range))]
                   for _ in range(n)]
        return prompts, [rng.randint(*output_range) for _ in range(n)]
    if kind == "fixed":
        n = n or 32
        gen = torch.Generator().manual_seed(seed)
        lens = [16 + i * (128 - 16) // max(n - 1, 1) for i in range(n)]
        return [torch.randint(1, vocab_size, (k,), generator=gen).tolist() for k in lens], [64] * n
    if kind == "chat":
        if tokenizer is None:
            tokenizer = chat_tokenizer()
        n = n or 16
        return chat_prompts(tokenizer, n), [64] * n
    raise ValueError(f"workload must be one of {WORKLOADS}, got {kind!r}")


def left_padded(prompts: list) -> tuple:
    """(input_ids, attention_mask) int64 [len(prompts), longest]: each prompt left-padded with 0s,
    as padded `model.generate` takes a batch."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def check_common_args(parser, args) -> None:
    """The checks bench_engine.py and bench_overlap.py share; applies --threads."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is "
                     "False)")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)


def cpu_features() -> dict:
    """What this CPU runs (for every figure's JSON): the ISA flags that pick our kernels and
    oneDNN's, torch's capability string and the bodies our kernels take here."""
    from cb_kernels import _C

    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line.split(":", 1)[1].split() for line in f
                             if line.startswith("flags")))
    except (OSError, StopIteration):
        pass
    return {"model": _cpu_name(), "cores": os.cpu_count(),
            "flags": [w for w in wanted if w in flags], "amx": "amx_tile" in flags,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "linear_isa": _C.linear_isa(), "linear_bf16_isa": _C.linear_bf16_isa()}


def versions() -> dict:
    import platform

    import transformers

    import cb_kernels

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cb_kernels": getattr(cb_kernels, "__version__", "?"), "python": platform.python_version(),
            "cpu": _cpu_name(), "cores": os.cpu_count(), "cpu_features": cpu_features()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "?"
