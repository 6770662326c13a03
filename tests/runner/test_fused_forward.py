"""The fused CPU forward (cb_kernels/runner/fused): which models it takes (the families in
runner/fused/families, exactly), and that its logits match transformers' forward on the same
packed weights and kernels (to fp32 rounding: the norms, SiLU and rotary run as fused C++
passes). Packed linears run on our kernel here, whose portable body runs on any CPU."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.runner import packed_linears
from cb_kernels.runner.fused.families import SPECS
from tests.helpers import make_model, random_prompts


@pytest.fixture(autouse=True)
def _our_packed_linears(monkeypatch):
    monkeypatch.setattr(packed_linears, "GEMM", "cbk")


def _engine(model, **kw):
    return Engine(model, EngineConfig(block_size=8, num_blocks=64, **kw))


@pytest.mark.parametrize("kind, applies", [
    ("llama", True), ("qwen2", True), ("qwen3", True), ("mistral", True),
    ("gemma", False), ("gemma2", False),      # (1 + weight) norms, softcaps: transformers' path
])
def test_applies_to_the_families_it_has_a_spec_for(kind, applies):
    assert (_engine(make_model(kind)).runner.fused is not None) == applies
    assert (kind in SPECS) == applies


def test_not_without_packed_weights_or_with_a_hook():
    assert _engine(make_model(), pack_weights=False).runner.fused is None
    model = make_model()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert _engine(model).runner.fused is None
    handle.remove()
    engine = _engine(model)
    assert engine.runner.fused.usable()
    handle = model.model.norm.register_forward_pre_hook(lambda *a: None)
    assert not engine.runner.fused.usable()   # a hook added later: transformers' path again
    handle.remove()


def test_subclasses_and_instance_forwards_keep_transformers_path():
    """A subclass may override forward, an instance forward replaces it: this path would skip
    both and silently compute the stock layer."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Halved(LlamaDecoderLayer):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 0.5

    model = make_model()
    model.model.layers[1].__class__ = Halved
    assert _engine(model).runner.fused is None
    model = make_model()
    mlp = model.model.layers[0].mlp
    stock = mlp.forward
    mlp.forward = lambda x: stock(x) * 2
    assert _engine(model).runner.fused is None
    del mlp.forward
    engine = _engine(model)
    assert engine.runner.fused.usable()
    model.model.norm.forward = lambda x: x              # patched after the engine was built
    assert not engine.runner.fused.usable()
    del model.model.norm.forward
    with engine.runner.packed:        # the packed linears' own forwards are no reason to stop
        assert engine.runner.fused.usable()


def test_a_norm_that_is_not_plain_rms_norm_keeps_transformers_path():
    model = make_model()
    norm = model.model.layers[0].post_attention_layernorm
    norm.variance_epsilon = 1        # an int eps: not the module this path knows
    assert _engine(model).runner.fused is None


class _Both:
    """Runs each step through the fused forward and through transformers' forward (same packed
    linears, same head); records whether their logits agree."""

    def __init__(self, runner):
        self.runner, self.fused, self.equal = runner, runner.fused, []

    def usable(self):
        return True

    def __call__(self, input_ids, positions, logits_indices, attn):
        rows = self.fused(input_ids, positions, logits_indices, attn)
        want = self.runner.forward_logits(input_ids, positions, logits_indices, attn)
        got = self.runner.head.logits(rows)
        self.equal.append(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
        return rows


WINDOWS = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)


@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("qwen2", WINDOWS), ("qwen3", WINDOWS),               # layer 1 slides, layer 0 does not
    ("mistral", {"sliding_window": 8}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4, "head_dim": 32}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 256}}),
], ids=["llama", "qwen2", "qwen3", "mistral", "qwen2-layer-windows", "qwen3-layer-windows",
        "mistral-window-8", "llama-biases", "llama-tied-mha-head-dim-32", "llama3-rope",
        "yarn-rope"])
@pytest.mark.one_thread
def test_logits_match_transformers_forward(kind, overrides):
    model = make_model(kind, seed=5, **overrides)
    engine = _engine(model, max_batch_tokens=16)       # chunked prefill, then decodes
    both = _Both(engine.runner)
    engine.runner.fused = both
    engine.generate(random_prompts([30, 3, 12], seed=4), SamplingParams(max_new_tokens=6))
    assert len(both.equal) >= 8 and all(both.equal)
