"""What the engine's warm-up (engine/warmup.py) costs at Engine() and what it buys the first call:
Engine() seconds, the warm-up's share, and the first generate() against the same call repeated,
at max_batch_tokens 2048 with the warm-up prefill at the whole budget or capped at 512
(warmup.PREFILL_TOKENS), 64 chat prompts x 64 tokens, bf16, EOS off, prefix cache emptied
before each call.

    python bench/warmup_cost.py smollm2-135m llama-1b-shape [--json PATH]

The Llama-3.2-1B shape is built on the meta device and filled with N(0, 0.02) (no checkpoint:
timing only)."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_workloads as W  # noqa: E402

from cb_kernels import Engine, EngineConfig, SamplingParams  # noqa: E402
from cb_kernels.engine import warmup  # noqa: E402


def smollm():
    return W.load_model("smollm2-135m", torch.bfloat16)[0]


def llama1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**W.LLAMA_1B, attn_implementation="sdpa", eos_token_id=None,
                      bos_token_id=1, pad_token_id=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
        for name, b in model.named_buffers():
            if "inv_freq" in name:
                half = b.numel()
                b.copy_(1.0 / (W.LLAMA_1B["rope_theta"] **
                               (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))))
    model.tie_weights()
    return W._no_eos(model, 0)


MODELS = {"smollm2-135m": smollm, "llama-1b-shape": llama1b}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--budgets", default="512:512,2048:2048,2048:512",
                   help="max_batch_tokens:warm-up prefill cap pairs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = W.chat_prompts(W.chat_tokenizer(), 64)
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)] * len(prompts)
    rows = []
    for name in args.models:
        model = MODELS[name]()
        for pair in args.budgets.split(","):
            budget, cap = (int(x) for x in pair.split(":"))
            warmup.PREFILL_TOKENS = cap
            t0 = time.perf_counter()
            engine = Engine(model, EngineConfig(max_batch_tokens=budget, cpu_offload_gib=0))
            init = time.perf_counter() - t0
            times = []
            for _ in range(2):
                engine.reset_prefix_cache()
                t0 = time.perf_counter()
                engine.generate(prompts, params)
                times.append(time.perf_counter() - t0)
            row = dict(model=name, budget=budget, warm_prefill=min(budget, cap),
                       engine_init_s=round(init, 2), warmup_s=round(engine.warmup_s, 2),
                       first_s=round(times[0], 2), steady_s=round(times[1], 2),
                       first_over_steady=round(times[0] / times[1], 3))
            print(json.dumps(row), flush=True)
            rows.append(row)
            del engine
            gc.collect()
        del model
        gc.collect()
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": W.cpu_features(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
