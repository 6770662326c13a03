"""transformers' generate_batch with its own sdpa path vs with cb_kernels' drop-in backend.

Same model, prompts and settings, measured in one run; prints tokens/s of each and the ratio, and
checks that greedy tokens agree. Default model: a random Llama (no download); `--model
smollm2-135m` or a checkpoint folder uses cb_kernels.models.load.

    python bench/bench_dropin.py [--model NAME] [--num-prompts 32] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch


def build_model(name: str | None, dtype: torch.dtype, device: str):
    if name is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
        return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    from cb_kernels.models import load

    model, _ = load(name, dtype=dtype)
    return model.to(device)


def make_prompts(num_prompts: int, vocab_size: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (num_prompts,), generator=gen)
    return [torch.randint(3, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]


def run(model, prompts, max_new_tokens: int, args) -> tuple[float, list]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    # Explicit sizes: transformers' defaults (8192-token steps, 60% of RAM) make its CPU path
    # several times slower; the same tuned sizes serve both sides (notes/transformers-cb.md).
    cb_config = ContinuousBatchingConfig(page_size=args.block_size, num_blocks=args.num_blocks,
                                         max_batch_tokens=args.max_batch_tokens,
                                         auto_switch_to_flash=False)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen_config,
                               continuous_batching_config=cb_config)
    elapsed = time.perf_counter() - start
    return elapsed, [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="built-in name or checkpoint folder (default: random Llama)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--repeats", type=int, default=1, help="alternate the two paths this many times")
    args = p.parse_args(argv)

    import cb_kernels.hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    default_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype
    model = build_model(args.model, dtype, device)
    prompts = make_prompts(args.num_prompts, model.config.vocab_size)
    num_tokens = args.num_prompts * args.max_new_tokens
    run(model, prompts[:2], 4, args)  # warm up both code paths once
    times = {"sdpa": [], "cb_kernels": []}
    tokens = {}
    for _ in range(args.repeats):
        cb_kernels.hf.disable()
        t, tokens["sdpa"] = run(model, prompts, args.max_new_tokens, args)
        times["sdpa"].append(t)
        cb_kernels.hf.enable(model)
        t, tokens["cb_kernels"] = run(model, prompts, args.max_new_tokens, args)
        times["cb_kernels"].append(t)
    cb_kernels.hf.disable()

    print(f"device={device} dtype={dtype} threads={torch.get_num_threads()} prompts={args.num_prompts} "
          f"new_tokens={args.max_new_tokens} block_size={args.block_size} "
          f"max_batch_tokens={args.max_batch_tokens}")
    best = {k: min(v) for k, v in times.items()}
    for k, t in best.items():
        print(f"  generate_batch {k:<11} {num_tokens / t:8.1f} tok/s  (best of {args.repeats}: {t:.2f} s)")
    print(f"  ratio cb_kernels / sdpa: {best['sdpa'] / best['cb_kernels']:.2f}x")
    same = sum(a == b for a, b in zip(tokens["sdpa"], tokens["cb_kernels"]))
    print(f"  greedy tokens identical for {same}/{len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
