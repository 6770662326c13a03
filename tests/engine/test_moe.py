"""MoE models on ops.moe_experts: the experts modules that map onto the op (transformers'
`use_experts_implementation` with the default silu gate) run on it inside engine steps, with
model.generate's fp32 tokens; the packed experts follow the weights (a write in place, a
load_state_dict(assign=True)); modules that do not map keep transformers' code, logged; the
user's model is unchanged after the steps."""
from __future__ import annotations

import logging

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.ops import moe as moe_ops
from cb_kernels.ops.moe import PackedExperts
from cb_kernels.runner import moe_layers
from tests.model_sweep import VOCAB, generate_tokens, tiny_model

pytestmark = pytest.mark.one_thread

FAMILIES = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2),
    "qwen3_moe": {},
    "mixtral": {},
    "olmoe": {},
}


def prompts(seed=0, lengths=(5, 17, 30)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(engine, prompt_list, max_new=10):
    outs = engine.generate(prompt_list, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    return [o.token_ids for o in outs]


class CountCalls:
    """Counts the op's engine entries while installed: PackedExperts.run_unchecked, and the
    engine's Qwen3-Next forward's ops.moe_block calls with experts (the MoE block whole)."""

    def __init__(self, monkeypatch):
        from cb_kernels.runner import hybrid_layers

        self.n = 0
        original = PackedExperts.run_unchecked
        block = hybrid_layers.moe_block_unchecked

        def counted(experts, *args, **kwargs):
            self.n += 1
            return original(experts, *args, **kwargs)

        def counted_block(x, *args, **kwargs):
            self.n += args[6] is not None          # experts: an MoE block, not a dense MLP
            return block(x, *args, **kwargs)
        monkeypatch.setattr(PackedExperts, "run_unchecked", counted)
        monkeypatch.setattr(hybrid_layers, "moe_block_unchecked", counted_block)


@pytest.fixture
def moe_on(monkeypatch):
    """The op on whatever body runs here (the portable one where the SIMD body does not)."""
    monkeypatch.setattr(moe_layers, "MOE", "on")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_run_on_the_op_with_generates_tokens(family, moe_on, monkeypatch, caplog):
    model = tiny_model(family, seed=3, **FAMILIES[family])
    ps = prompts()
    want = generate_tokens(model, ps, 10)
    calls = CountCalls(monkeypatch)
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        engine = Engine(model, EngineConfig(max_batch_tokens=24))    # chunked prefills too
    assert "experts modules on ops.moe_experts" in caplog.text
    assert run(engine, ps) == want
    assert calls.n > 0
    # The user's model keeps transformers' experts forward outside the steps.
    assert not any("forward" in m.__dict__ for m in model.modules())
    n = calls.n
    assert generate_tokens(model, ps[:1], 3) == [want[0][:3]] and calls.n == n


@pytest.mark.parametrize("update", ["in_place", "load_state_dict_assign"])
def test_packed_experts_follow_the_weights(update, moe_on, monkeypatch):
    model = tiny_model("qwen3_next", seed=4, **FAMILIES["qwen3_next"])
    ps = prompts(seed=1)
    engine = Engine(model, EngineConfig())
    before = run(engine, ps)
    assert before == generate_tokens(model, ps, 10)
    experts = [m for m in model.modules() if type(m).__name__ == "Qwen3NextExperts"]
    g = torch.Generator().manual_seed(9)
    if update == "in_place":
        with torch.no_grad():
            for m in experts:
                m.down_proj.mul_(-3.0)
                m.gate_up_proj.add_(torch.randn(m.gate_up_proj.shape, generator=g))
    else:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for name, v in state.items():
            if name.endswith("experts.down_proj"):
                state[name] = v * -3.0
            elif name.endswith("experts.gate_up_proj"):
                state[name] = v + torch.randn(v.shape, generator=g)
        model.load_state_dict(state, assign=True)
    want = generate_tokens(model, ps, 10)
    assert want != before                    # the change matters to the tokens
    calls = CountCalls(monkeypatch)
    assert run(engine, ps) == want
    assert calls.n > 0


def test_experts_that_do_not_map_keep_transformers_code(moe_on, caplog):
    model = tiny_model("gpt_oss", seed=3)        # its own clamped gate
    ps = prompts(seed=2)
    with caplog.at_level(logging.INFO, logger="cb_kernels.engine"):
        engine = Engine(model, EngineConfig())
    assert "GptOssExperts experts modules keep transformers' code: its own gating" in caplog.text
    assert run(engine, ps) == generate_tokens(model, ps, 10)


def test_moe_off_keeps_transformers_code(monkeypatch):
    monkeypatch.setattr(moe_layers, "MOE", "off")
    model = tiny_model("mixtral", seed=3)
    calls = CountCalls(monkeypatch)
    ps = prompts(seed=3)
    assert run(Engine(model, EngineConfig()), ps) == generate_tokens(model, ps, 10)
    assert calls.n == 0


def test_bf16_layer_output_within_tolerance_of_its_own_forward(moe_on):
    """bf16: the op against the experts module's own (grouped_mm) forward on a routed batch
    from the model's router; both round every step to bf16, the sums' order differs."""
    model = tiny_model("qwen3_next", seed=5, **FAMILIES["qwen3_next"]).to(torch.bfloat16)
    block = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextSparseMoeBlock")
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.inference_mode():
        _, w, ids = block.gate(x)
        want = block.experts(x, ids, w)
        group = moe_layers.ExpertsGroup(block.experts)
        group.refresh()
        got = group.run(x, ids, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_router_logits_packed_and_following_the_weight(moe_on):
    """Qwen3-Next's top-k router (the same forward as Qwen3-MoE's, OLMoE's, ...) runs its logits
    on a packed weight; a write to the router weight alone changes the tokens as in generate."""
    model = tiny_model("qwen3_next", seed=6, **FAMILIES["qwen3_next"])
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3NextTopKRouter"]
    assert routers and all(moe_layers.router_maps(m, torch.float32) for m in routers)
    ps = prompts(seed=4)
    engine = Engine(model, EngineConfig())
    before = run(engine, ps)
    assert before == generate_tokens(model, ps, 10)
    with torch.no_grad():
        for m in routers:
            m.weight.copy_(torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(1)) * 4)
    want = generate_tokens(model, ps, 10)
    assert want != before
    assert run(engine, ps) == want
    x = torch.randn(9, model.config.hidden_size)
    group = moe_layers.RouterGroup(routers[0])
    group.refresh()
    with torch.inference_mode():
        own, ours = routers[0](x), group.run(x)
    assert torch.equal(own[2], ours[2])
    torch.testing.assert_close(ours[1], own[1], rtol=1e-5, atol=1e-6)


def test_sleep_level_2_frees_the_packed_experts_and_wake_up_repacks(moe_on):
    """The packed experts and the op's per-thread work buffers (its [num_tokens * top_k,
    hidden] fp32 contributions) are freed; wake_up repacks from the weights as they are then."""
    model = tiny_model("mixtral", seed=7)
    ps = prompts(seed=5)
    engine = Engine(model, EngineConfig())
    want = run(engine, ps)
    held = moe_ops.workspace_bytes()
    # the prefill's contributions alone: 52 prompt tokens x top_k x hidden fp32
    assert held >= sum(map(len, ps)) * model.config.num_experts_per_tok * \
        model.config.hidden_size * 4
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    packed_bytes = sum(t.numel() * t.element_size() for m in experts
                       for t in (m.gate_up_proj, m.down_proj))
    groups = engine.runner.packed.experts
    assert groups and all(g.experts is not None for g in groups)
    freed = engine.sleep(level=2)
    assert freed >= packed_bytes + held
    assert all(g.experts is None for g in groups)      # the packed copies are gone
    assert moe_ops.workspace_bytes() == 0              # and the op's buffers
    with torch.no_grad():                  # a trainer's step while asleep, through `.data`:
        for m in experts:                  # no version bump, so only wake_up's repack sees it
            m.down_proj.data.mul_(-2.0)
    engine.wake_up()
    assert run(engine, ps) == generate_tokens(model, ps, 10) != want


def test_inputs_the_op_does_not_take_go_to_the_modules_own_forward(moe_on):
    """Another dtype than the weights' (autocast) is the module's own forward, not the op."""
    model = tiny_model("qwen3_moe", seed=8)
    block = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock")
    group = moe_layers.ExpertsGroup(block.experts)
    group.refresh()
    x = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        _, w, ids = block.gate(x)
        want = block.experts(x.double(), ids, w.double())
        got = group.run(x.double(), ids, w.double())
    assert got.dtype == torch.float64 and torch.equal(got, want)
