"""The fused CPU forward (cb_kernels/runner/fused): which models it takes (the families in
runner/fused/families, exactly), and that its logits match transformers' forward on the same
packed weights and kernels (to fp32 rounding: the norms, SiLU and rotary run as fused C++
passes). Packed linears run on our kernel here, whose portable body runs on any CPU."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.runner import packed_linears
from cb_kernels.runner.fused import forward
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


class _NativeAndLoop:
    """Runs each step through FusedDecoder (one C++ call) and through the Python loop it
    replaces; records whether the rows are bit-identical (both write the same K/V)."""

    def __init__(self, fused):
        self.fused, self.equal = fused, []

    def usable(self):
        return True

    def __call__(self, input_ids, positions, logits_indices, attn):
        forward.NATIVE = False
        try:
            want = self.fused(input_ids, positions, logits_indices, attn)
        finally:
            forward.NATIVE = True
        got = self.fused(input_ids, positions, logits_indices, attn)
        self.equal.append(torch.equal(got, want))
        return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, overrides", [
    ("llama", {}), ("qwen2", WINDOWS), ("mistral", {"sliding_window": 8}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4, "head_dim": 32}),
], ids=["llama", "qwen2-layer-windows", "mistral-window-8", "llama-biases", "llama-mha-32"])
@pytest.mark.one_thread
def test_fused_decoder_gives_the_python_loops_bits(kind, overrides, dtype):
    model = make_model(kind, seed=6, **overrides).to(dtype)
    engine = _engine(model, max_batch_tokens=16)       # chunked prefill, then decodes
    assert engine.runner.fused.native is not None
    both = _NativeAndLoop(engine.runner.fused)
    engine.runner.fused = both
    engine.generate(random_prompts([30, 3, 12], seed=4), SamplingParams(max_new_tokens=6))
    assert len(both.equal) >= 8 and all(both.equal)
    assert both.fused._table          # the native call ran


def test_fused_decoder_is_not_used_where_it_does_not_fit(monkeypatch):
    # q/k norms (Qwen3): the Python loop
    assert _engine(make_model("qwen3")).runner.fused.native is None
    # our packed kernel switched off: the loop over oneDNN or F.linear
    engine = _engine(make_model())
    monkeypatch.setattr(packed_linears, "GEMM", "torch")
    engine.runner.refresh_weights()
    assert engine.runner.fused._native_table(_FakeStep(engine.runner)) is None


class _FakeStep:
    def __init__(self, runner):
        self.layout = runner.layout


def test_fused_decoder_rebuilds_its_table_when_a_weight_is_replaced():
    model = make_model(seed=2)
    engine = _engine(model)
    prompts = random_prompts([9, 5], seed=1)
    engine.generate(prompts, SamplingParams(max_new_tokens=4))
    table = list(engine.runner.fused._table)
    layer = model.model.layers[1]
    layer.post_attention_layernorm.weight = torch.nn.Parameter(
        layer.post_attention_layernorm.weight.detach() * 2)
    layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight.detach() * 0.5)
    engine.weights_updated()
    got = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert engine.runner.fused._table != table
    forward.NATIVE = False
    try:
        engine.weights_updated()
        want = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    finally:
        forward.NATIVE = True
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_fused_decoder_refuses_bad_tables_and_tensors():
    from cb_kernels import ops
    dec = ops.FusedDecoder(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                           eps=1e-6, scale=0.25, dtype=torch.float32)
    lin = ops.PackedLinear(torch.randn(128, 64))
    caches = [torch.zeros(4, 8, 2, 16)]
    norm = torch.ones(64)
    with pytest.raises(ValueError, match=r"layer 0 o must be a torch.float32 PackedLinear of \[n, k\] = \[64, 64\]"):
        dec.layer_table([(norm, norm, lin, lin, lin, lin, None)], caches, caches)
    with pytest.raises(ValueError, match="layer 0 in_norm weight"):
        dec.layer_table([(norm[:32], norm, lin, lin, lin, lin, None)], caches, caches)
    with pytest.raises(ValueError, match="one k and v cache per layer"):
        dec.layer_table([(norm, norm, lin, lin, lin, lin, None)], caches * 2, caches)
    with pytest.raises(ValueError, match="heads .4. must be a multiple of kv_heads .3."):
        ops.FusedDecoder(hidden=64, heads=4, kv_heads=3, head_dim=16, intermediate=128,
                         eps=1e-6, scale=0.25, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_table_equals_the_module_and_grows(dtype):
    model = make_model(seed=1).to(dtype)
    table = _engine(model).runner.fused.rotary
    assert table.cached
    x = torch.zeros(1, 1, 64, dtype=dtype)
    for positions in (torch.tensor([3, 0, 7]), torch.tensor([8191, 5, 4500]), torch.tensor([9])):
        got = table(x, positions)
        want = model.model.rotary_emb(x, positions[None])
        assert torch.equal(got[0], want[0][0]) and torch.equal(got[1], want[1][0])
    assert table.cos.shape[0] == 8192
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)          # a new frequency: the table follows
    got = table(x, torch.tensor([11]))
    assert torch.equal(got[0], model.model.rotary_emb(x, torch.tensor([[11]]))[0][0])


def test_rotary_table_is_not_used_for_length_dependent_rope():
    model = make_model(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                        "factor": 2.0})
    assert not _engine(model).runner.fused.rotary.cached
