"""bf16 models on the CPU fast path: packed bf16 linears, the fused forward in bf16, a bf16 KV
cache. Checked (1) against transformers' own bf16 forward on the same model, (2) against the
fp32 model (the reference), within the tolerances stated here, and (3) for batch invariance:
a request's logits have the same bits alone and in a batch, on every GEMM path this CPU runs
(oneDNN's bf16 matmul; F.linear, the portable one)."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams, ops
from cb_kernels.runner import packed_linears
from cb_kernels.runner.base import StepOutput
from tests.helpers import make_model, random_prompts, reference_tokens

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
# bf16 keeps 8 significant bits (one rounding: a relative error up to 2^-9). Tolerances as
# max |diff| / max |logit| of a step:
# - against transformers' bf16 forward on the same packed weights and attention: the fused
#   passes round where transformers' ops round, measured 0 (identical logits) on every step
#   here; 2^-7 leaves room for a 1-ulp difference of the SiLU's exp or the norm's sum order.
# - against the fp32 model: measured at most 0.0072 on these models; 0.02 bounds it.
TOL_VS_TRANSFORMERS_BF16 = 2 ** -7
TOL_VS_FP32 = 0.02

GEMMS = ["cbk"] + [g for g in ("onednn", "torch")
                   if g != "onednn" or packed_linears.onednn_bf16_native()]


@pytest.fixture(params=GEMMS)
def gemm(request, monkeypatch):
    """Each test on every bf16 GEMM path this CPU runs natively, and the portable ones (our
    kernel's portable body runs where the CPU lacks AVX512-BF16)."""
    monkeypatch.setattr(packed_linears, "GEMM", request.param)
    assert packed_linears.gemm(torch.bfloat16) == request.param
    return request.param


def _engine(model, **kw):
    return Engine(model, EngineConfig(block_size=8, num_blocks=96, **kw))


def _rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


class _Recorder:
    """Wraps runner.execute: every step returns full logits, recorded per (request, tokens so
    far), so a request's logits can be compared across runs."""

    def __init__(self, runner):
        self.runner, self.execute, self.rows = runner, runner.execute, {}
        runner.execute = self

    def __call__(self, inputs, greedy=False):
        out = self.execute(inputs, False)
        for i, seq in enumerate(inputs.sampled):
            self.rows[(seq.request_id, len(seq.token_ids))] = out.logits[i].clone()
        if greedy:
            return StepOutput(None, ops.greedy_tokens(out.logits))
        return StepOutput(out.logits, None)


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.one_thread
def test_fused_bf16_runs_and_matches_transformers_bf16_forward(kind, gemm):
    model = make_model(kind, seed=3).to(torch.bfloat16)
    engine = _engine(model, max_batch_tokens=16)        # chunked prefill, then decodes
    runner = engine.runner
    assert runner.fused is not None and runner.packed is not None
    assert runner.k_caches[0].dtype == torch.bfloat16
    fused, worst = runner.fused, []

    class Both:
        def usable(self):
            return True

        def __call__(self, input_ids, positions, logits_indices, attn):
            rows = fused(input_ids, positions, logits_indices, attn)
            want = runner.forward_logits(input_ids, positions, logits_indices, attn)
            if len(logits_indices):        # a prefill chunk that samples nothing has no rows
                worst.append(_rel(runner.head.logits(rows), want))
            return rows

    runner.fused = Both()
    engine.generate(random_prompts([30, 3, 12], seed=4), SamplingParams(max_new_tokens=6))
    assert len(worst) >= 6 and max(worst) <= TOL_VS_TRANSFORMERS_BF16, worst


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.one_thread
def test_bf16_logits_close_to_the_fp32_model(kind, gemm):
    """The engine's bf16 logits for the prompts' last tokens against the fp32 model's own."""
    fp32 = make_model(kind, seed=3)
    prompts = random_prompts([21, 7, 40], seed=6)
    engine = _engine(make_model(kind, seed=3).to(torch.bfloat16))
    rec = _Recorder(engine.runner)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=1))
    with torch.inference_mode():
        for out, p in zip(outs, prompts):
            want = fp32(input_ids=torch.tensor([p])).logits[0, -1]
            got = rec.rows[(out.request_id, len(p))]
            assert _rel(got, want) <= TOL_VS_FP32


@pytest.mark.one_thread
def test_bf16_greedy_tokens_mostly_match_transformers_generate(gemm):
    """bf16 rounding may flip a near-tie, so not every token must match; most do."""
    model = make_model("llama", seed=1).to(torch.bfloat16)
    prompts = random_prompts([9, 17, 30, 5, 12, 22], seed=2)
    outs = _engine(model).generate(prompts, SamplingParams(max_new_tokens=10))
    want = reference_tokens(model, prompts, 10)
    same = sum(a == b for o, w in zip(outs, want) for a, b in zip(o.token_ids, w))
    assert same >= 0.8 * 60, same


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.one_thread
def test_bf16_logits_are_batch_invariant_bit_for_bit(kind, gemm):
    """Request 0's logits at every step: alone, then among five others of other lengths (other
    row counts in every GEMM, other attention partitions) with chunked prefill: same bits."""
    model = make_model(kind, seed=2).to(torch.bfloat16)
    prompts = random_prompts([19, 4, 33, 11, 26, 8], seed=8)
    params = SamplingParams(max_new_tokens=8)
    alone = _engine(model, max_batch_tokens=64)
    rec_alone = _Recorder(alone.runner)
    rid = alone.generate(prompts[:1], params)[0].request_id
    mixed = _engine(model, max_batch_tokens=64)
    rec_mixed = _Recorder(mixed.runner)
    rid_mixed = mixed.generate(prompts, params)[0].request_id
    steps = sorted(n for r, n in rec_alone.rows if r == rid)
    assert len(steps) == 8
    for n in steps:
        a, b = rec_alone.rows[(rid, n)], rec_mixed.rows[(rid_mixed, n)]
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"differs at {n} tokens"


def test_fp16_model_keeps_transformers_forward_and_says_why(caplog):
    model = make_model("llama").to(torch.float16)
    with caplog.at_level("INFO", logger="cb_kernels.engine"):
        engine = _engine(model)
    assert engine.runner.packed is None and engine.runner.fused is None
    assert "float16 weights are not packed" in caplog.text
    outs = engine.generate(random_prompts([6, 9], seed=1), SamplingParams(max_new_tokens=4))
    assert all(len(o.token_ids) == 4 for o in outs)


def test_engine_dtype_must_be_the_models():
    """EngineConfig(dtype=...) names the dtype the engine runs in; a model of another dtype is
    refused at construction (its first K/V write would fail inside a step otherwise)."""
    with pytest.raises(ValueError, match=r"dtype='bfloat16' but the model computes in torch.float32"):
        _engine(make_model(), dtype="bfloat16")
    engine = _engine(make_model().to(torch.bfloat16), dtype="bfloat16")
    assert engine.runner.k_caches[0].dtype == torch.bfloat16 and engine.runner.fused is not None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.one_thread
def test_bf16_greedy_head_gives_the_bf16_logits_tokens(kind):
    """On all-greedy steps the greedy head answers for bf16 heads too (the argmax of the exact
    logits rounded to bf16, the rule of the bf16 logits' argmax): same tokens as the full head."""
    model = make_model(kind, seed=4).to(torch.bfloat16)
    prompts = random_prompts([14, 6, 27, 9], seed=3)
    params = SamplingParams(max_new_tokens=12)
    with_head = _engine(model, greedy_head=True)
    assert with_head.runner.head.greedy is not None
    got = [o.token_ids for o in with_head.generate(prompts, params)]
    assert with_head.stats()["greedy_head_steps"] > 0
    want = [o.token_ids for o in _engine(model, greedy_head=False).generate(prompts, params)]
    assert got == want


def test_bf16_gemm_choice_follows_the_cpu(monkeypatch):
    """auto: our vdpbf16ps kernel where the CPU has AVX512-BF16 and no AMX, oneDNN (its AMX
    tiles) where it has AMX, F.linear where oneDNN has no native bf16; each can be forced."""
    from cb_kernels.ops.linear import PackedLinear

    monkeypatch.setattr(packed_linears, "GEMM", "auto")
    monkeypatch.setattr(PackedLinear, "fast", staticmethod(lambda dtype=torch.float32: True))
    monkeypatch.setattr(packed_linears, "onednn_bf16_native", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert packed_linears.gemm(torch.bfloat16) == "cbk"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert packed_linears.gemm(torch.bfloat16) == "onednn"
    monkeypatch.setattr(PackedLinear, "fast", staticmethod(lambda dtype=torch.float32: False))
    monkeypatch.setattr(packed_linears, "onednn_bf16_native", lambda: False)
    assert packed_linears.gemm(torch.bfloat16) == "torch"
    for forced in ("cbk", "onednn", "torch"):
        monkeypatch.setattr(packed_linears, "GEMM", forced)
        assert packed_linears.gemm(torch.bfloat16) == forced
    assert packed_linears.gemm(torch.float16) is None


def test_a_norm_kept_in_fp32_beside_bf16_linears_is_not_fused():
    """The fused passes take every tensor in x's dtype: a norm left in fp32 beside bf16 linears
    (as `_keep_in_fp32_modules` leaves some) must not reach them (its weight would be read as
    bf16)."""
    from cb_kernels.runner.fused import FusedForward

    model = make_model("llama", seed=2).to(torch.bfloat16)
    runner = _engine(model).runner
    args = (runner.packed, runner.num_layers, runner.num_heads, runner.num_kv_heads)
    assert FusedForward.build(model, *args) is not None
    model.model.layers[1].post_attention_layernorm.float()
    assert FusedForward.build(model, *args) is None
