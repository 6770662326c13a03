"""TransformersRunner across model families: greedy parity with generate (sliding window, softcap,
GQA, q/k norms), no dense mask, and the user's model left as it was."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels import ops
from cb_kernels.runner import attention as attention_mod
from cb_kernels.runner.kv_cache import host_zeros
from cb_kernels.runner.transformers_runner import TransformersRunner
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens, run_checked

pytestmark = pytest.mark.one_thread

# Prompts longer than the sliding window (24) so the window really cuts.
LENGTHS, NEW = [30, 4, 45, 17], [10, 14, 6, 30]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3"])
def test_family_greedy_matches_generate(kind):
    model = make_model(kind, seed=1)
    prompts = random_prompts(LENGTHS, seed=6)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=40,
                                        attention_backend=ATTN_BACKEND))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, NEW)]
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == reference_tokens(model, prompts, NEW)


def test_sliding_window_and_softcap_come_from_the_model():
    model = make_model("gemma2", seed=2, layer_types=["sliding_attention", "full_attention"])
    a = TransformersRunner(model)
    assert a.sliding_windows == [24, None] and a.softcap == 5.0
    seen = []
    real = ops.paged_attention

    def spy(*args, **kwargs):
        seen.append((kwargs["sliding_window"], kwargs["softcap"]))
        return real(*args, **kwargs)

    ops.paged_attention = spy
    try:
        engine = Engine(model, EngineConfig(block_size=8, num_blocks=16,
                                            attention_backend=ATTN_BACKEND))
        engine.generate(random_prompts([30], seed=1), SamplingParams(max_new_tokens=2))
    finally:
        ops.paged_attention = real
    assert seen[:2] == [(24, 5.0), (None, 5.0)]


def test_no_dense_mask_and_no_cache_object_reach_attention():
    from transformers import AttentionInterface

    model = make_model("llama", seed=3)
    # pack_weights=False: transformers' forward (the Llama family's own path is in
    # tests/runner/test_fused_forward.py).
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16, pack_weights=False,
                                        attention_backend=ATTN_BACKEND))
    calls = []

    def checking(module, query, key, value, attention_mask, **kwargs):
        calls.append((attention_mask, kwargs.get("cache"), kwargs.get("past_key_values"),
                      tuple(query.shape)))
        return attention_mod.engine_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(attention_mod.ATTN_NAME, checking)
    try:
        engine.generate(random_prompts([9, 5], seed=2), SamplingParams(max_new_tokens=3))
    finally:
        AttentionInterface.register(attention_mod.ATTN_NAME, attention_mod.engine_attention)
    assert calls and all(m is None and c is None and p is None for m, c, p, _ in calls)
    assert calls[0][3] == (1, 4, 14, 16)       # one packed row of 9 + 5 prompt tokens


def test_user_model_is_left_as_it_was():
    model = make_model("llama", seed=4)
    prompts = random_prompts([6], seed=3)
    before = reference_tokens(model, prompts, 5)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16,
                                        attention_backend=ATTN_BACKEND))
    engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert model.config._attn_implementation == "sdpa"
    assert reference_tokens(model, prompts, 5) == before
    with pytest.raises(RuntimeError, match="runs only inside cb_kernels.Engine steps"):
        attention_mod.engine_attention(model.model.layers[0].self_attn, torch.zeros(1, 4, 1, 16),
                                      torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), None)


def test_two_engines_on_one_model_in_two_threads():
    """Engine B steps while engine A's forward is halfway: a hook on layer 0 (which also keeps
    transformers' forward, where the model is switched) starts B and waits for it to reach
    layer 0. Without the model lock, A leaving would restore the model under B's forward, and B
    leaving would put A's attention name and packed forwards back on the model for good. With
    it, B waits for A's step (the hook's wait times out)."""
    import threading

    model = make_model("llama", seed=6)
    prompts = random_prompts([7, 12], seed=8)
    want = reference_tokens(model, prompts, 5)
    cfg = EngineConfig(block_size=8, num_blocks=32, pack_weights=True,
                       attention_backend=ATTN_BACKEND)
    first, second = Engine(model, cfg), Engine(model, cfg)
    b_inside, a_done, got = threading.Event(), threading.Event(), {}
    worker = threading.Thread(target=lambda: got.update(
        b=second.generate([prompts[1]], SamplingParams(max_new_tokens=5))))

    def hook(module, args, output):
        if threading.current_thread() is worker:
            b_inside.set()
            a_done.wait(timeout=5)
        elif not worker.is_alive() and not a_done.is_set():
            worker.start()
            b_inside.wait(timeout=0.5)

    def after_a(real):
        def run(*args):
            try:
                return real(*args)
            finally:
                if worker.ident is not None:
                    a_done.set()
        return run
    first.runner.execute = after_a(first.runner.execute)
    handle = model.model.layers[0].register_forward_hook(hook)
    try:
        outs = first.generate([prompts[0]], SamplingParams(max_new_tokens=5))
        worker.join(timeout=60)
    finally:
        handle.remove()
    assert outs[0].token_ids == want[0] and got["b"][0].token_ids == want[1]
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_non_attention_interface_model_is_rejected():
    with pytest.raises(TypeError, match="must be a transformers causal LM"):
        Engine(object(), EngineConfig(num_blocks=4))
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(make_model("llama"), {"num_blocks": 4})


def test_model_without_logits_to_keep_projects_all_tokens():
    model = make_model("llama", seed=5)
    prompts = random_prompts([12, 3], seed=4)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16,
                                        attention_backend=ATTN_BACKEND))
    assert engine.runner._keeps_logits
    engine.runner._keeps_logits = False
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_zeros_are_zero_writable_and_outlive_their_mapping(dtype):
    import gc

    t = host_zeros((5, 16, 2, 8), dtype)
    assert t.shape == (5, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    gc.collect()                       # only the tensor holds the mapping now
    t[3, 7] = 1.5
    assert t.float().sum().item() == 1.5 * 16
