"""runner/support.py, attention_layers.py and masks.py: what the construction probe finds and
refuses, on transformers' own mask functions and tiny models (tests/test_model_sweep.py runs every
type)."""
from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from cb_kernels import Engine, EngineConfig, SamplingParams, UnsupportedModelError
from cb_kernels.runner.masks import mask_pattern, tensor_is_causal
from helpers import make_model, random_prompts, reference_tokens, run_checked
from model_sweep import generate_tokens, prompts, tiny_model

MASKS = [
    ("causal", lambda: mu.causal_mask_function, ("full", None)),
    ("window-4096", lambda: mu.sliding_window_causal_mask_function(4096), ("window", 4096)),
    ("window-1", lambda: mu.sliding_window_causal_mask_function(1), ("window", 1)),
    ("chunk-8192", lambda: mu.chunked_causal_mask_function(8192, torch.zeros(1, dtype=torch.long)),
     ("chunk", 8192)),
    ("chunk-3", lambda: mu.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long)),
     ("chunk", 3)),
]


@pytest.mark.parametrize("make,want", [m[1:] for m in MASKS], ids=[m[0] for m in MASKS])
def test_mask_pattern_of_transformers_mask_functions(make, want):
    assert mask_pattern(make(), max_positions=1 << 20, num_probe_tokens=6) == want


def test_mask_pattern_refuses_bidirectional_and_odd_masks():
    kind, why = mask_pattern(mu.bidirectional_mask_function, 1 << 20, 6)
    assert kind == "other" and "later tokens" in why

    def every_other(b, h, q, kv):          # causal, but not one range of keys
        return (kv <= q) & ((q - kv) % 2 == 0)

    kind, why = mask_pattern(every_other, 1 << 20, 6)
    assert kind == "other" and "one range" in why


def test_tensor_is_causal():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert tensor_is_causal(causal[None, None])
    additive = torch.zeros(5, 5).masked_fill(~causal, float("-inf"))
    assert tensor_is_causal(additive[None, None])
    assert not tensor_is_causal((additive + 0.5)[None, None])        # an ALiBi-like bias


@pytest.mark.one_thread
def test_chunked_attention_under_preemption_and_mixed_batches():
    """llama4_text's chunked layers (chunk 8, block 4) over prompts crossing several chunks, with
    a pool so small that requests are preempted and recomputed: generate's tokens."""
    model = tiny_model("llama4_text")
    ps = prompts(seed=1) + [list(range(2, 30))]
    want = generate_tokens(model, ps, 6)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=10, max_batch_tokens=16,
                                        preemption="recompute"))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in ps]
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == want
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["recomputes"] > 0


def test_chunk_size_must_be_a_multiple_of_block_size():
    model = tiny_model("llama4_text")
    with pytest.raises(UnsupportedModelError, match="chunks of 8 tokens.*block_size=16"):
        Engine(model, EngineConfig(block_size=16, num_blocks=16))


def test_refusal_is_a_not_implemented_error_naming_the_feature():
    model = tiny_model("diffllama")
    with pytest.raises(NotImplementedError, match="repeated layer indices"):
        Engine(model, EngineConfig(block_size=4, num_blocks=16))


@pytest.mark.one_thread
def test_mistral_window_comes_from_its_mask():
    """Mistral's window (24) reaches the kernel from the probe's mask, and the model keeps its
    own attention for generate afterwards."""
    model = make_model("mistral")
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64))
    assert engine.runner.sliding_windows == [24, 24]
    ps = random_prompts([40, 7])
    outs = engine.generate(ps, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(model, ps, 5)


@pytest.mark.one_thread
def test_the_sweep_sees_an_ignored_window_chunk_or_sink(monkeypatch):
    """The sweep's tiny models and prompts are long enough that dropping a window, a chunk or
    the sinks changes the tokens: SAME in tests/test_model_sweep.py is not vacuous."""
    from cb_kernels.runner import attention, attention_layers
    from model_sweep import check

    monkeypatch.setattr(attention_layers, "mask_pattern", lambda fn, mp, n: ("full", None))
    monkeypatch.setattr(attention_layers, "_cache_windows", lambda cfg, n: [])
    assert check("phimoe")[0] == "wrong"          # its window
    assert check("llama4_text")[0] == "wrong"     # its chunks
    monkeypatch.undo()

    real = attention.ops.paged_attention

    def without_sinks(*args, sinks=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.ops, "paged_attention", without_sinks)
    assert check("gpt_oss")[0] == "wrong"


def test_an_encoder_is_refused_as_bidirectional():
    model = tiny_model("bert", is_decoder=False)
    with pytest.raises(UnsupportedModelError, match="attends bidirectionally"):
        Engine(model, EngineConfig(block_size=4, num_blocks=16))


def test_bart_style_positions_come_from_the_step_and_the_model_is_restored():
    """BART-style decoders count positions themselves; the engine hands its step's positions to
    their positional embedding (runner/positions.py) only inside a forward."""
    from cb_kernels.runner.positions import position_modules

    model = tiny_model("bart")
    mods = position_modules(model)
    assert len(mods) == 1 and type(mods[0]).__name__ == "BartLearnedPositionalEmbedding"
    ps = prompts()
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, prefix_caching=False))
    outs = engine.generate(ps, SamplingParams(max_new_tokens=5, ignore_eos=True))
    with torch.no_grad():
        for out, p in zip(outs, ps):
            ref = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)
            assert out.token_ids == ref[0, len(p):].tolist()
    assert not any("forward" in m.__dict__ for m in model.modules())
