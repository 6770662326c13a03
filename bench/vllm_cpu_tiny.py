"""vLLM-CPU vs padded ``model.generate`` on a tiny random Llama (issue 5's orientation numbers).

Run through ``python bench/vllm_cpu.py --tiny-llama --json bench/results/vllm_cpu_tiny.json``.
The padded-generate baseline runs in this process (the project's torch and transformers) before
and after vLLM, so the two HF timings bracket the vLLM run and show how noisy the shared machine
was; the ratio vLLM / padded generate is the number to keep.
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


def measure_tiny_llama(venv=DEFAULT_VENV, timeout_s=1800):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=PAD_ID)
    model = LlamaForCausalLM(config).eval().to(torch.float32)
    model.generation_config.eos_token_id = None
    prompts = tiny_prompts(config.vocab_size)
    padded_generate(model, prompts[:4], 8)
    hf_before, hf_ids = padded_generate(model, prompts, MAX_NEW_TOKENS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cbk_tiny_llama_") as model_dir:
        model.save_pretrained(model_dir)
        vllm = run_vllm(model_dir, prompts, MAX_NEW_TOKENS, venv=venv, timeout_s=timeout_s)
    load_after = os.getloadavg()
    hf_after, _ = padded_generate(model, prompts, MAX_NEW_TOKENS)
    same, prefix = _agreement(vllm["token_ids"], hf_ids)
    hf_mean = (hf_before + hf_after) / 2
    return {
        "model": {"arch": "LlamaForCausalLM", **TINY_LLAMA, "dtype": "float32"},
        "workload": {"num_prompts": NUM_PROMPTS, "prompt_lens": [len(p) for p in prompts],
                     "max_new_tokens": MAX_NEW_TOKENS, "greedy": True, "ignore_eos": True},
        "hf_padded_generate_tokens_per_s": {"before_vllm": hf_before, "after_vllm": hf_after},
        "vllm_tokens_per_s": vllm["tokens_per_s"],
        "vllm_startup_s": vllm["startup_s"],
        "vllm_generate_s": vllm["generate_s"],
        "vllm_version": vllm["vllm_version"],
        "vllm_env": vllm["env"],
        "ratio_vllm_over_hf_padded": vllm["tokens_per_s"] / hf_mean,
        "prompts_with_identical_tokens": same,
        "mean_common_prefix_tokens": prefix,
        "loadavg_1_5_15": {"before_vllm": load_before, "after_vllm": load_after},
        "torch_threads_hf": torch.get_num_threads(),
        "hf_token_ids": hf_ids,
        "vllm_token_ids": vllm["token_ids"],
    }
