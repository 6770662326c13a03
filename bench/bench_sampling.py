"""The per-step cost of the sampling work (cb_kernels/engine/sampler.py) with every feature on.

    python bench/bench_sampling.py [--device cuda] [--dtype bfloat16] [--requests 256]
                                   [--layers 30] [--steps 4] [--json out.json]
    python bench/bench_sampling.py --rollouts [--prompts 64] [--new-tokens 64] [--layers 30]

A random model of SmolLM2-135M's shape (30 layers, hidden 576, vocab 49152, tied head) runs
`--requests` sequences at once: requests/8 prompts with n=8 samples each, temperature 1, top_k 50,
top_p 0.9, min_p 0.05, repetition/frequency/presence penalties, a logit bias, min_new_tokens,
logprobs=5 and prompt_logprobs=1 (stop strings are left out: they need the real tokenizer, and
their cost is host detokenization, not a step's tensor work). After every prefill is done it
times `--steps` decode steps and, inside them, the Sampler's calls. It prints the sampler's share
of the step, and two baselines measured in the same run with the same engine and number of
sequences: plain sampling (temperature 1, no other feature: full logits, the same draw) and
all-greedy (no feature: the greedy head where it applies). `step / plain step` is what the
features cost on top of sampling at all.

--rollouts: RL rollouts instead, `--prompts` prompts x n=8 samples at temperature 1 with
logprobs=1, through the Engine and through transformers' generate_batch with
num_return_sequences=8 (the same model, in the same run); prints tokens/s of both and the ratio.

Measured on the 2-core dev box, CPU fp32, while other jobs shared it (load average 4-20, so
each figure moved by 30% between runs): 256 sequences, 30 layers: sampling 9-11% of a
1.5-2.2 s step, the step 1.08x the plain-sampling one; --rollouts --layers 4 --new-tokens 16:
Engine 376 tok/s, generate_batch 47 tok/s (7.9x).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "cb_kernels")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import cb_kernels  # noqa: E402,F401  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(layers: int, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dict(SMOLLM2_135M, num_hidden_layers=layers), attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def all_features(max_new_tokens: int, seed: int):
    from cb_kernels import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=50, top_p=0.9,
                          min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
                          presence_penalty=0.1, logit_bias={11: 1.5, 42: -2.0}, min_new_tokens=2,
                          logprobs=5, prompt_logprobs=1, n=8, seed=seed)


class TimedSampler:
    """Wraps the engine's Sampler: seconds spent in its calls (device synchronized)."""

    def __init__(self, sampler, device):
        self.sampler, self.device, self.seconds = sampler, device, 0.0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, *args):
        self._sync()
        t0 = time.perf_counter()
        out = self.sampler(*args)
        self._sync()
        self.seconds += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def time_steps(engine, steps: int) -> float:
    """Seconds per step of `steps` decode steps (after the prefills)."""
    while engine.stats()["waiting"] or any(not s.is_decoding for s in engine.scheduler.running):
        engine.step()
    engine.step()                     # the first step after the prefills (forks' copies)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def run(args) -> dict:
    from cb_kernels import Engine, EngineConfig, SamplingParams

    model = build_model(args.layers, args.device, DTYPES[args.dtype])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests // 8)]
    new = args.steps + 8
    cfg = EngineConfig(block_size=16, num_blocks=args.requests * 4 + 64, max_num_seqs=args.requests,
                       max_batch_tokens=max(args.requests, 2048))
    engine = Engine(model, cfg)
    timed = engine.loop.sampler = TimedSampler(engine.loop.sampler, engine.runner.device)
    for i, p in enumerate(prompts):
        engine.add_request(p, all_features(new, i))
    while engine.stats()["running"] < args.requests:     # prefills and forks
        engine.step()
    timed.seconds = 0.0
    step_s = time_steps(engine, args.steps)
    sampler_s = timed.seconds / (args.steps + 1)        # the untimed warm step is included
    running = engine.stats()["running"]
    while engine.has_unfinished():
        engine.step()
    # The baselines: the same engine, the same number of sequences.
    base = {}
    for name, params in (("plain", SamplingParams(max_new_tokens=new, temperature=1.0, seed=1)),
                         ("greedy", SamplingParams(max_new_tokens=new))):
        for i in range(args.requests):
            engine.add_request(prompts[i % len(prompts)] + [i], params)
        base[name] = time_steps(engine, args.steps)
        while engine.has_unfinished():
            engine.step()
    return {"device": args.device, "dtype": args.dtype, "layers": args.layers,
            "requests": running, "step_ms": step_s * 1e3, "sampler_ms": sampler_s * 1e3,
            "sampler_share": sampler_s / step_s, "plain_step_ms": base["plain"] * 1e3,
            "step_vs_plain": step_s / base["plain"], "greedy_step_ms": base["greedy"] * 1e3,
            "step_vs_greedy": step_s / base["greedy"]}


def _generate_batch(model, prompts, gen, new: int):
    """generate_batch's loop with the manager built (cache sized, warm-up done) before the
    clock starts, as the Engine is built before its clock: (seconds, generated tokens)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    num = len(prompts) * gen.num_return_sequences
    hints = WorkloadHints(max(map(len, prompts)), new, num)
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5,
                                                   workload_hints=hints) as manager:
        t0 = time.perf_counter()
        manager.add_requests(inputs=prompts, max_new_tokens=new)
        results = {}
        while len(results) < num:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("generate_batch's thread stopped early")
        seconds = time.perf_counter() - t0
    errors = [r.error for r in results.values() if r.error]
    if errors:
        raise RuntimeError(f"generate_batch failed {len(errors)} requests: {errors[0]}")
    return seconds, sum(len(r.generated_tokens) for r in results.values())


def rollouts(args) -> dict:
    from transformers import GenerationConfig

    from cb_kernels import Engine, EngineConfig, SamplingParams

    model = build_model(args.layers, args.device, DTYPES[args.dtype])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (args.prompts,), generator=g)]
    new = args.new_tokens
    engine = Engine(model, EngineConfig(cpu_offload_gib=0))
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, n=8))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=new, temperature=1.0, n=8,
                                                    logprobs=1, seed=i)
                                     for i in range(len(prompts))])
    ours = time.perf_counter() - t0
    num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    del engine
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           num_return_sequences=8, max_new_tokens=new, eos_token_id=None,
                           pad_token_id=0)
    theirs, their_tokens = _generate_batch(model, prompts, gen, new)
    return {"device": args.device, "dtype": args.dtype, "layers": args.layers,
            "sequences": len(prompts) * 8, "engine_tok_s": num_tokens / ours,
            "generate_batch_tok_s": their_tokens / theirs,
            "speedup": (num_tokens / ours) / (their_tokens / theirs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--requests", type=int, default=256, help="running sequences (a multiple of 8)")
    p.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--rollouts", action="store_true", help="rollouts vs generate_batch instead")
    p.add_argument("--prompts", type=int, default=64, help="--rollouts: prompts (x n=8)")
    p.add_argument("--new-tokens", type=int, default=64, help="--rollouts: tokens per sample")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.rollouts:
        r = rollouts(args)
        print(f"rollouts, {r['sequences']} sequences, {r['layers']} layers, {r['device']} "
              f"{r['dtype']}: Engine {r['engine_tok_s']:.0f} tok/s, generate_batch "
              f"{r['generate_batch_tok_s']:.0f} tok/s ({r['speedup']:.2f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    if args.requests % 8 or args.requests < 8:
        p.error("--requests must be a positive multiple of 8 (n=8 samples per prompt)")
    r = run(args)
    print(f"{r['requests']} sequences, {r['layers']} layers, {r['device']} {r['dtype']}: "
          f"step {r['step_ms']:.1f} ms, sampling {r['sampler_ms']:.1f} ms = "
          f"{100 * r['sampler_share']:.1f}% of the step; plain-sampling step "
          f"{r['plain_step_ms']:.1f} ms ({r['step_vs_plain']:.2f}x), all-greedy step "
          f"{r['greedy_step_ms']:.1f} ms ({r['step_vs_greedy']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
