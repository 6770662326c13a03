"""The drop-in backend: transformers' generate_batch on cb_kernels' paged attention gives the same
tokens as its own sdpa path, reads the cache in place, and refuses what it cannot serve."""
import pytest
import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

import cb_kernels.hf
from cb_kernels import ops
from cb_kernels.hf import dropin

# Prompt lengths cross the 16-token page boundary and exceed the 48-token step budget (chunked
# prefill); 1 is the shortest prompt there is.
PROMPT_LENS = (5, 17, 33, 9, 40, 1)


def _refusal() -> str | None:
    try:
        dropin.check_version()
    except RuntimeError as e:
        return str(e)
    return None


# On a transformers pyproject allows but the drop-in was not written for (5.17: another cache
# layout), enable() refuses by design; the tests that enable it skip there, naming why, and
# test_enable_refuses_an_unsupported_installed_version checks the refusal instead.
REFUSAL = _refusal()
supported_only = pytest.mark.skipif(REFUSAL is not None,
                                    reason=f"the drop-in refuses this transformers: {REFUSAL}")


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return model, prompts


@pytest.fixture(autouse=True)
def _always_disable():
    yield
    cb_kernels.hf.disable()


def _generate_batch(model, prompts, max_new_tokens=20):
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    cb_config = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=48)
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@supported_only
@pytest.mark.one_thread
def test_same_tokens_as_sdpa_and_kernels_used(tiny_llama, monkeypatch):
    model, prompts = tiny_llama
    expected = _generate_batch(model, prompts)
    assert all(len(t) == 20 for t in expected)

    attention = _Counter(ops.paged_attention)
    write = _Counter(ops.write_kv)
    monkeypatch.setattr(ops, "paged_attention", attention)
    monkeypatch.setattr(ops, "write_kv", write)
    cb_kernels.hf.enable(model)
    original = dropin._state["patched"]
    sdpa = {name: _Counter(fn) for name, fn in original.sdpa.items()}
    update = _Counter(original.update)
    monkeypatch.setattr(original, "sdpa", sdpa)
    monkeypatch.setattr(original, "update", update)
    got = _generate_batch(model, prompts)

    assert got == expected
    layers = model.config.num_hidden_layers
    assert attention.calls >= 20 * layers and attention.calls == write.calls
    # transformers' gathering update and its sdpa never ran: the cache was read in place
    assert sum(c.calls for c in sdpa.values()) == 0 and update.calls == 0


@supported_only
def test_disable_restores_transformers(tiny_llama):
    model, prompts = tiny_llama
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import cache, input_outputs

    before = (dict(AttentionInterface._global_mapping), cache.PagedAttentionCache.update,
              input_outputs.attn_mask_is_needed)
    cb_kernels.hf.enable(model)
    cb_kernels.hf.enable(model)  # idempotent
    assert cb_kernels.hf.is_enabled()
    cb_kernels.hf.disable()
    after = (dict(AttentionInterface._global_mapping), cache.PagedAttentionCache.update,
             input_outputs.attn_mask_is_needed)
    assert after == before and not cb_kernels.hf.is_enabled()


@supported_only
def test_plain_forward_unchanged_while_enabled(tiny_llama):
    model, prompts = tiny_llama
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        expected = model(ids).logits
        cb_kernels.hf.enable(model)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@supported_only
def test_installed_transformers_is_supported():
    # Fails loudly when the pinned transformers moves past the versions whose internals the
    # drop-in was written against: update dropin.py (and SUPPORTED_VERSIONS) then.
    dropin.check_version()
    assert ".".join(transformers.__version__.split(".")[:2]) in dropin.SUPPORTED_VERSIONS


@pytest.mark.skipif(REFUSAL is None, reason="the installed transformers is supported: nothing to refuse")
def test_enable_refuses_an_unsupported_installed_version(tiny_llama):
    with pytest.raises(RuntimeError, match="supports transformers"):
        cb_kernels.hf.enable(tiny_llama[0])
    assert not dropin.is_enabled()      # nothing was patched


@pytest.mark.parametrize("version", ["5.17.0", "5.16.2", "5.25.0", "6.0.0"])
def test_unsupported_versions_refused(version):
    with pytest.raises(RuntimeError, match="supports transformers"):
        dropin.check_version(version)


@supported_only
def test_refuses_sliding_window_models():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding-window"):
        cb_kernels.hf.enable(LlamaForCausalLM(config))


@supported_only
def test_refuses_non_models():
    with pytest.raises(TypeError, match="model"):
        cb_kernels.hf.enable("not a model")
