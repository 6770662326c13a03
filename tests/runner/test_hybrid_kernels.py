"""runner/hybrid_kernels.py: which stateful layers run on cb_kernels' ops, and that one call over
a mixed batch (fresh prefills, a continued chunk, decodes) gives each row what the layer's own
transformers code gives it alone (fp32 within 1e-4 relative, bf16 within 3e-2); a kernel that
computes something else is refused at construction and the layer keeps transformers' code, with
generate's tokens."""
from __future__ import annotations

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams, ops
from cb_kernels.runner import hybrid_kernels
from cb_kernels.runner.state_cache import StatePool, _Group
from cb_kernels.runner.state_layers import probe_specs, state_modules
from tests.model_sweep import VOCAB, generate_tokens, tiny_model

FAMILIES = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    # Two value heads per key head: b, a and z are strided views of the fused projections
    # (fp32, where .float() copies nothing).
    "qwen3_next:2v-per-k": dict(layer_types=["linear_attention", "full_attention"],
                                linear_num_key_heads=2, linear_num_value_heads=4),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "mamba2": {},
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
}


def layer_and_entry(family, dtype, num_slots=4):
    model = tiny_model(family.split(":")[0], seed=5, **FAMILIES[family]).to(dtype)
    modules = state_modules(model)
    specs = probe_specs(model, modules)
    pool = StatePool(specs, num_slots, torch.device("cpu"))
    idx = sorted(modules)[0]
    return modules[idx][0], pool.by_layer[idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_rows_in_one_call_match_the_layer_alone(family, dtype):
    module, entry = layer_and_entry(family, dtype)
    kernels, reason = hybrid_kernels.kernel_for(module, entry)
    assert kernels is not None, reason
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 16, module.hidden_size, generator=gen).to(dtype)
    with torch.inference_mode():
        # row A: 5 fresh tokens; row B: 4 fresh, then (next call) a 3-token chunk; row C: 3
        # fresh then a decode. Call 1: A, B's first 4, C's first 3; call 2: B's chunk, C's decode.
        a, b1, b2, c1, c2 = (hidden[:, 0:5], hidden[:, 5:9], hidden[:, 9:12], hidden[:, 12:15],
                             hidden[:, 15:16])
        slots = torch.tensor([2, 0, 3])
        rows1 = hybrid_kernels.VarlenRows([_Group(slice(0, 5), slots[0:1], False),
                                           _Group(slice(5, 9), slots[1:2], False),
                                           _Group(slice(9, 12), slots[2:3], False)])
        out1 = kernels(torch.cat([a, b1, c1], dim=1), rows1)
        rows2 = hybrid_kernels.VarlenRows([_Group(torch.tensor([3]), slots[2:3], True),
                                           _Group(slice(0, 3), slots[1:2], True)])
        out2 = kernels(torch.cat([b2, c2], dim=1), rows2)
        own = type(module).forward
        want_a = own(module, a)
        want_b = own(module, torch.cat([b1, b2], dim=1))
        want_c = own(module, torch.cat([c1, c2], dim=1))
    got = {"a": out1[:, 0:5], "b": torch.cat([out1[:, 5:9], out2[:, 0:3]], dim=1),
           "c": torch.cat([out1[:, 9:12], out2[:, 3:4]], dim=1)}
    rtol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, want in (("a", want_a), ("b", want_b), ("c", want_c)):
        scale = want.float().abs().max().item()
        err = (got[name].float() - want.float()).abs().max().item()
        assert err <= rtol * scale + 1e-6, (name, err, scale)


def test_layers_without_a_kernel_keep_their_code():
    module, entry = layer_and_entry("mamba2", torch.float32)
    assert hybrid_kernels.why_not(module, entry) == ""
    jamba = tiny_model("jamba", attn_layer_offset=1, attn_layer_period=2)
    mixer = next(m for m in jamba.modules() if type(m).__name__ == "JambaMambaMixer")
    assert hybrid_kernels.why_not(mixer, None) == "no kernel path for this layer class"
    bf16_state = {k: v.bfloat16() if k[0] == "recurrent" else v for k, v in entry.items()}
    assert "slots are" in hybrid_kernels.why_not(module, bf16_state)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_a_kernel_that_differs_is_refused_and_generate_tokens_kept(monkeypatch, caplog, fused):
    """The construction probe compares the kernels with the layer's own forward: a broken
    gated delta rule (the fused middle, or the separate op) is refused (logged) and the engine
    serves through transformers' code."""
    owner, name = (hybrid_kernels, "gated_delta_net_unchecked") if fused else \
        (ops, "gated_delta_rule_unchecked")
    real = getattr(owner, name)

    def off_by_a_bit(*args, **kw):
        out = real(*args, **kw)
        out.mul_(1.01)
        return out

    monkeypatch.setattr(hybrid_kernels, "FUSED", fused)
    monkeypatch.setattr(owner, name, off_by_a_bit)
    model = tiny_model("qwen3_next", seed=3, **FAMILIES["qwen3_next"])
    with caplog.at_level("INFO", logger="cb_kernels"):
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=32, max_num_seqs=2))
    wrapped = [w for _, w in engine.runner._states._wrapped]
    assert wrapped and all(w.kernel is None and "differ" in w.kernel_reason for w in wrapped)
    assert "transformers' code (the kernels differ" in caplog.text
    ps = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
          for n in (3, 9)]
    outs = engine.generate(ps, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == generate_tokens(model, ps, 4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_runs_the_kernels_and_logs_it(family, caplog):
    model = tiny_model(family.split(":")[0], seed=3, **FAMILIES[family])
    with caplog.at_level("INFO", logger="cb_kernels"):
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=32, max_num_seqs=2))
    wrapped = [w for _, w in engine.runner._states._wrapped]
    assert wrapped and all(w.kernel is not None for w in wrapped), \
        [w.kernel_reason for w in wrapped]
    assert "cb_kernels' causal_conv1d + " in caplog.text
