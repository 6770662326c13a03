"""vLLM-CPU vs padded ``model.generate`` on a tiny random Llama (a quick check of
the vLLM venv and of its lead before a full bench_engine.py --vllm run).

Run through ``python bench/vllm_cpu.py --tiny-llama --json bench/results/vllm_cpu_tiny.json``.
The padded-generate baseline runs in this process (the project's torch and transformers)
``repeats`` times before and ``repeats`` times after vLLM, which also generates the batch
``repeats`` times; the ratio of the best runs on each side is the number to keep, since on a shared
2-core machine other processes only ever slow a run down. All runs are kept to show the noise.
"""

import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_cpu import DEFAULT_VENV, run_vllm

TINY_LLAMA = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, intermediate_size=1024,
                  max_position_embeddings=512)
NUM_PROMPTS = 32
MAX_NEW_TOKENS = 64
MIN_PROMPT_LEN, MAX_PROMPT_LEN = 16, 128
PAD_ID = 0


def tiny_prompts(vocab_size, seed=0):
    """32 prompts spread evenly over 16..128 tokens, ids in [1, vocab_size)."""
    gen = torch.Generator().manual_seed(seed)
    span = MAX_PROMPT_LEN - MIN_PROMPT_LEN
    lens = [MIN_PROMPT_LEN + i * span // (NUM_PROMPTS - 1) for i in range(NUM_PROMPTS)]
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lens]


def padded_generate(model, prompts, max_new_tokens):
    """Greedy ``model.generate`` on one left-padded batch; returns (tokens/s, token ids)."""
    longest = max(len(p) for p in prompts)
    # input_ids, attention_mask: [num_seqs, longest], left-padded
    input_ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, longest - len(ids):] = torch.tensor(ids)
        attention_mask[i, longest - len(ids):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=PAD_ID)
    elapsed = time.perf_counter() - start
    new = out[:, longest:]
    return new.numel() / elapsed, new.tolist()


def _agreement(a, b):
    """Prompts with identical tokens, and the mean length of the common prefix."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(n)
    return same, sum(prefix) / len(prefix)


def _best_of(model, prompts, repeats):
    runs = [padded_generate(model, prompts, MAX_NEW_TOKENS) for _ in range(repeats)]
    if any(ids != runs[0][1] for _, ids in runs):
        raise RuntimeError("greedy model.generate output changed between repeats")
    return [rate for rate, _ in runs], runs[0][1]


def measure_tiny_llama(repeats=3, venv=DEFAULT_VENV, timeout_s=1800):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID)
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.generation_config.eos_token_id = None
    prompts = tiny_prompts(config.vocab_size)
    padded_generate(model, prompts[:4], 8)
    hf_before, hf_ids = _best_of(model, prompts, repeats)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cbk_tiny_llama_") as model_dir:
        model.save_pretrained(model_dir)
        vllm = run_vllm(model_dir, prompts, MAX_NEW_TOKENS, repeats=repeats, venv=venv,
                        timeout_s=timeout_s)
    load_after = os.getloadavg()
    hf_after, _ = _best_of(model, prompts, repeats)
    same, prefix = _agreement(vllm["token_ids"], hf_ids)
    hf_best = max(hf_before + hf_after)
    return {
        "model": {"arch": "LlamaForCausalLM", **TINY_LLAMA, "dtype": "float32"},
        "workload": {"num_prompts": NUM_PROMPTS, "prompt_lens": [len(p) for p in prompts],
                     "max_new_tokens": MAX_NEW_TOKENS, "greedy": True, "ignore_eos": True},
        "hf_padded_generate_tokens_per_s": {"before_vllm": hf_before, "after_vllm": hf_after},
        "hf_padded_generate_best_tokens_per_s": hf_best,
        "vllm_tokens_per_s_all": vllm["tokens_per_s_all"],
        "vllm_best_tokens_per_s": vllm["tokens_per_s"],
        "vllm_startup_s": vllm["startup_s"],
        "vllm_generate_s": vllm["generate_s"],
        "vllm_version": vllm["vllm_version"],
        "vllm_env": vllm["env"],
        "ratio_best_vllm_over_best_hf_padded": vllm["tokens_per_s"] / hf_best,
        "prompts_with_identical_tokens": same,
        "mean_common_prefix_tokens": prefix,
        "loadavg_1_5_15": {"before_vllm": load_before, "after_vllm": load_after},
        "torch_threads_hf": torch.get_num_threads(),
        "hf_token_ids": hf_ids,
        "vllm_token_ids": vllm["token_ids"],
    }
