"""EngineConfig.greedy_head: all-greedy CPU steps take their tokens from the greedy head
(ops/greedy_head.py) and still produce transformers' generate's tokens; other steps, other
weights and non-finite hidden states take the fp32 head."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.ops import GreedyHead
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens, run_checked

pytestmark = pytest.mark.one_thread

LENGTHS = [5, 37, 12, 64, 1, 23]
NEW = [12, 5, 20, 8, 16, 10]


def run(model, prompts, params, **cfg):
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, block_size=8,
                                        num_blocks=128, max_batch_tokens=64, **cfg))
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    outs = run_checked(engine)
    return [outs[i].token_ids for i in ids], engine


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}), ("qwen3", {}), ("qwen2", {"tie_word_embeddings": True}),
])
def test_greedy_head_gives_generates_tokens(kind, overrides):
    model = make_model(kind, **overrides)
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(max_new_tokens=n) for n in NEW]
    want = reference_tokens(model, prompts, NEW)
    on, engine_on = run(model, prompts, params, greedy_head=True)
    off, engine_off = run(model, prompts, params, greedy_head=False)
    assert on == want and off == want
    assert engine_on.stats()["greedy_head_steps"] > 0
    assert engine_off.stats()["greedy_head_steps"] == 0


def test_auto_follows_the_cpu():
    model = make_model("llama")
    _, engine = run(model, random_prompts([4], seed=1), [SamplingParams(max_new_tokens=3)])
    assert (engine.stats()["greedy_head_steps"] > 0) == GreedyHead.fast()


def test_steps_with_sampled_rows_use_the_fp32_head():
    model = make_model("llama")
    prompts = random_prompts(LENGTHS, seed=4)
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, seed=k) if k % 2 else
              SamplingParams(max_new_tokens=n) for k, n in enumerate(NEW)]
    on, engine = run(model, prompts, params, greedy_head=True)
    off, _ = run(model, prompts, params, greedy_head=False)
    assert on == off                               # seeded samples, greedy rows: same tokens
    greedy = [k for k in range(len(NEW)) if k % 2 == 0]
    want = reference_tokens(model, [prompts[k] for k in greedy], [NEW[k] for k in greedy])
    assert [on[k] for k in greedy] == want
    # Mixed steps never run it; once the sampled requests are done, greedy-only steps do.
    s = engine.stats()
    assert 0 < s["greedy_head_steps"] < s["steps"]


def test_replaced_head_weight_is_followed():
    model = make_model("llama", seed=7)
    prompts = random_prompts(LENGTHS[:3], seed=5)
    params = [SamplingParams(max_new_tokens=n) for n in NEW[:3]]
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, greedy_head=True))
    first = engine.generate(prompts, params)
    assert [o.token_ids for o in first] == reference_tokens(model, prompts, NEW[:3])
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
    second = engine.generate(prompts, params)
    want = reference_tokens(model, prompts, NEW[:3])
    assert [o.token_ids for o in second] == want and want != [o.token_ids for o in first]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)             # written in place
    third = engine.generate(prompts, params)
    assert [o.token_ids for o in third] == reference_tokens(model, prompts, NEW[:3])
    assert engine.stats()["greedy_head_steps"] > 0


def test_non_finite_hidden_states_take_the_fp32_head():
    """NaN logits: torch.argmax (and so generate) answers the first NaN's index, 0; the greedy
    head refuses the row and the fp32 head's argmax gives the same."""
    model = make_model("llama", seed=8)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    prompts = random_prompts([6, 9], seed=6)
    got, engine = run(model, prompts, [SamplingParams(max_new_tokens=4)] * 2, greedy_head=True)
    assert got == reference_tokens(model, prompts, [4, 4]) == [[0] * 4] * 2
    assert engine.stats()["greedy_head_steps"] == 0


def test_bad_setting():
    with pytest.raises(ValueError, match="greedy_head must be 'auto', True or False"):
        EngineConfig(greedy_head="yes")


@pytest.mark.parametrize("kind, greedy_head", [("gemma", True), ("llama", False)])
def test_greedy_steps_without_the_head_run_in_inference_mode(kind, greedy_head):
    """All-greedy steps on transformers' forward (no fused path), with the greedy head (Gemma:
    its logits are its head's output, so the runner runs the decoder and the head) or without it,
    run in inference mode, not building an autograd graph through weights that require grad."""
    model = make_model(kind).requires_grad_(True)
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, pack_weights=False,
                                        greedy_head=greedy_head))
    if kind == "llama":
        model.lm_head.register_forward_hook(lambda m, i, o: None)
    assert engine.runner.fused is None
    assert (getattr(engine.runner.head, "greedy", None) is not None) == greedy_head
    modes = []
    model.model.register_forward_pre_hook(
        lambda m, args: modes.append(torch.is_inference_mode_enabled()))
    prompts = random_prompts([5, 7], seed=2)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=3)] * 2)
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, [3, 3])
    assert modes and all(modes)


def test_bias_added_to_the_head_mid_run_is_honoured():
    model = make_model("llama", seed=3)
    prompts = random_prompts([5, 7], seed=1)
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, greedy_head=True))
    engine.generate(prompts, [SamplingParams(max_new_tokens=2)] * 2)
    bias = torch.zeros(model.lm_head.weight.shape[0])
    bias[17] = 100.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=3)] * 2)
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, [3, 3]) \
        == [[17] * 3] * 2


def _bump_token_7(module, args, output):
    output[..., 7] += 1e4
    return output


@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("where", ["hook-on-model", "forward-on-model", "forward-on-head"])
def test_the_model_and_its_head_keep_their_hooks_and_instance_forwards(kind, where):
    """With the greedy head on, a hook or an instance forward on the CausalLM or on its LM head
    still runs (the engine takes the model's forward, or the head module's full logits)."""
    model = make_model(kind, seed=2)
    prompts = random_prompts([5, 9], seed=4)
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, greedy_head=True))
    if where == "hook-on-model":
        model.register_forward_hook(lambda m, a, out: out.logits.__setitem__(
            (Ellipsis, 7), out.logits[..., 7] + 1e4))
    elif where == "forward-on-model":
        stock = model.forward

        def forward(*a, **k):
            out = stock(*a, **k)
            out.logits[..., 7] += 1e4
            return out
        model.forward = forward
    else:
        stock_head = model.lm_head.forward
        model.lm_head.forward = lambda x: _bump_token_7(None, None, stock_head(x))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, [4, 4]) == [[7] * 4] * 2


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_replaced_head_module_is_used(kind):
    model = make_model(kind, seed=2)
    prompts = random_prompts([5, 9], seed=4)
    engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, greedy_head=True))
    engine.generate(prompts, SamplingParams(max_new_tokens=2))
    torch.manual_seed(9)
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features,
                                    bias=False)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, [4, 4])
    assert engine.runner.head.module is model.lm_head
