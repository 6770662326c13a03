"""Packed linears (cb_kernels/hf/packed_linears.py): which linears they take, that the model's
outputs stay the model's, that leaving restores the model, and the engine's tokens with and
without them."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.hf.packed_linears import PackedLinears, supported
from tests.engine.tiny_models import make_model, random_prompts, reference_tokens

pytestmark = pytest.mark.skipif(not supported(), reason="torch without oneDNN linear ops")


def _groups(packed):
    return sorted(tuple(m.out_features for m in g.members) for g in packed.groups)


def test_groups_siblings_that_read_one_input():
    model = make_model("qwen2")           # q/k/v with biases, gate/up without
    packed = PackedLinears.build(model, True)
    # Per layer: q/k/v fused (64 + 32 + 32), gate/up fused, o and down alone; plus the LM head.
    assert _groups(packed) == sorted([(64, 32, 32), (128, 128), (64,), (64,)] * 2 + [(500,)])


def test_builds_only_when_asked_and_for_cpu_fp32(monkeypatch):
    assert PackedLinears.build(make_model(), False) is None
    assert PackedLinears.build(make_model().to(torch.bfloat16), True) is None
    monkeypatch.setattr("cb_kernels.engine.sizing.host_available_bytes", lambda: 1 << 20)
    assert PackedLinears.build(make_model(), "auto") is None      # the copy would not fit
    assert PackedLinears.build(make_model(), True) is not None    # forced


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2"])
@pytest.mark.one_thread
def test_logits_match_the_model_and_leaving_restores_it(kind):
    model = make_model(kind)
    packed = PackedLinears.build(model, True)
    ids = torch.randint(0, 500, (1, 13))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        with packed:
            assert all("forward" in m.__dict__ for g in packed.groups for m in g.members)
            got = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, want)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.one_thread
def test_follows_weight_changes_and_sibling_calls_with_other_inputs():
    model = make_model()
    attn = model.model.layers[0].self_attn
    packed = PackedLinears.build(model, True)
    x, y = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        with packed:
            q = attn.q_proj(x)
            k_other = attn.k_proj(y)          # not the input q_proj saw: computed on its own
            v = attn.v_proj(x)
        torch.testing.assert_close(q, x @ attn.q_proj.weight.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_other, y @ attn.k_proj.weight.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, x @ attn.v_proj.weight.t(), rtol=1e-5, atol=1e-5)
        attn.k_proj.weight.mul_(3)            # an in-place change must repack
        with packed:
            attn.q_proj(x)
            k = attn.k_proj(x)
        torch.testing.assert_close(k, x @ attn.k_proj.weight.t(), rtol=1e-5, atol=1e-5)


def test_keeps_a_forward_someone_else_installed():
    model = make_model()
    lin = model.model.layers[0].mlp.down_proj
    calls = []

    def hooked(x):
        calls.append(1)
        return torch.nn.Linear.forward(lin, x)
    lin.forward = hooked
    with torch.no_grad(), PackedLinears.build(model, True):
        lin(torch.randn(2, 128))
    assert lin.forward is hooked and not calls      # packed inside, the user's one restored
    lin(torch.randn(2, 128))
    assert calls == [1]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="pack_weights"):
        EngineConfig(pack_weights="yes")


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.one_thread
def test_engine_tokens_equal_generate_either_way(pack):
    model = make_model()
    prompts = random_prompts([5, 17, 40, 9], seed=3)
    engine = Engine(model, EngineConfig(pack_weights=pack))
    assert (engine.adapter._packed is not None) == pack
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, 12)
    assert not any("forward" in m.__dict__ for m in model.modules())
