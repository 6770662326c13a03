"""What following the weights costs a step: Engine.check_weights() (engine/weights.py's per-step
identity compare, plus the flag of torch's registration hooks) against a 16-request greedy
decode step of a random model (the default runner), beside the full tree walk the hooks spare
and the per-parameter Python compare the check used before (its baseline). Models: a
SmolLM2-135M-shaped Llama (272 parameter tensors); bench_hybrid's 4-layer Qwen3-Next MoE shape;
a Qwen3-MoE with Qwen3-30B-A3B's 48 layers at a small width (the most parameter tensors).

    python bench/bench_weight_watch.py --threads 2 --repeats 200 --model smollm2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cb_kernels  # noqa: E402  (before torch: sets the OpenMP spin bound)
import torch  # noqa: E402
from bench_sampling import build_model  # noqa: E402
from cb_kernels import Engine, EngineConfig, SamplingParams  # noqa: E402

VOCAB = {"smollm2": 49152, "qwen3-next-hd128": 32000, "qwen3-moe-48": 32000}


def build(name: str, dtype: torch.dtype):
    if name == "smollm2":
        return build_model(30, "cpu", dtype)
    if name == "qwen3-next-hd128":
        from bench_hybrid import build as build_hybrid
        return build_hybrid(name).to(dtype).eval()
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=VOCAB[name], hidden_size=256, intermediate_size=512, num_hidden_layers=48,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=64, max_position_embeddings=4096)
    return tf.Qwen3MoeForCausalLM(cfg).to(dtype).eval()


def per_parameter_key(params: list) -> list:
    """The check's key as it was computed before (a Python call per parameter): the baseline."""
    return [(p.data_ptr(), 0 if p.is_inference() else p._version) for p in params]


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--model", choices=sorted(VOCAB), default="smollm2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.model, getattr(torch, args.dtype))
    engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, overlap="off"))
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        engine.add_request(torch.randint(1, VOCAB[args.model], (32,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=1000, ignore_eos=True))
    for _ in range(3):          # prefill and warm up
        engine.step()
    steps = []
    for _ in range(max(5, args.repeats // 20)):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    steps.sort()
    step_ms = steps[len(steps) // 2] * 1e3
    check_ms = median_ms(engine.check_weights, args.repeats)
    walk_ms = median_ms(lambda: list(model.parameters()), args.repeats)
    params = engine.weights.params
    old = per_parameter_key(params)
    before_ms = median_ms(lambda: per_parameter_key(params) == old, args.repeats)
    print(f"{args.model} {args.dtype}: params {len(params)}  decode step (16 requests) "
          f"{step_ms:.2f} ms  check_weights {check_ms:.3f} ms ({100 * check_ms / step_ms:.2f}% "
          f"of the step)  per-parameter compare (before) {before_ms:.3f} ms "
          f"({100 * before_ms / step_ms:.2f}%)  tree walk {walk_ms:.3f} ms  "
          f"threads {args.threads}")


if __name__ == "__main__":
    main()
