"""The Llama family's own forward (cb_kernels/hf/fast_llama.py): when it applies, and that its
logits are bit-equal to transformers' forward on the same packed weights and kernels."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.hf.packed_linears import supported
from tests.engine.tiny_models import make_model, random_prompts

pytestmark = pytest.mark.skipif(not supported(), reason="torch without oneDNN linear ops")


def _engine(model, **kw):
    return Engine(model, EngineConfig(block_size=8, num_blocks=64, **kw))


@pytest.mark.parametrize("kind, applies", [
    ("llama", True), ("qwen2", True), ("qwen3", True), ("mistral", True),
    ("gemma", False), ("gemma2", False),      # (1 + weight) norms, softcaps: transformers' path
])
def test_applies_to_the_llama_family_only(kind, applies):
    assert (_engine(make_model(kind)).adapter._fast is not None) == applies


def test_not_without_packed_weights_or_with_a_hook():
    assert _engine(make_model(), pack_weights=False).adapter._fast is None
    model = make_model()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert _engine(model).adapter._fast is None
    handle.remove()
    engine = _engine(model)
    assert engine.adapter._fast.usable()
    handle = model.model.norm.register_forward_pre_hook(lambda *a: None)
    assert not engine.adapter._fast.usable()   # a hook added later: transformers' path again
    handle.remove()


def test_a_norm_that_is_not_plain_rms_norm_keeps_transformers_path():
    model = make_model()
    norm = model.model.layers[0].post_attention_layernorm
    norm.variance_epsilon = 1        # an int eps: not the module this path knows
    assert _engine(model).adapter._fast is None


class _Both:
    """Runs each step through this path and through transformers' forward; records equality."""

    def __init__(self, adapter):
        self.adapter, self.fast, self.equal = adapter, adapter._fast, []

    def usable(self):
        return True

    def __call__(self, *args):
        got = self.fast(*args)
        self.adapter._fast = None          # transformers' forward, same packed linears
        try:
            want = self.adapter.forward(*args)
        finally:
            self.adapter._fast = self
        self.equal.append(torch.equal(got, want))
        return got


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.one_thread
def test_logits_bit_equal_to_transformers_forward(kind):
    model = make_model(kind, seed=5)
    engine = _engine(model, max_batch_tokens=16)       # chunked prefill, then decodes
    both = _Both(engine.adapter)
    engine.adapter._fast = both
    engine.generate(random_prompts([30, 3, 12], seed=4), SamplingParams(max_new_tokens=6))
    assert len(both.equal) >= 8 and all(both.equal)
