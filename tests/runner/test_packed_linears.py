"""Packed linears (cb_kernels/runner/packed_linears.py): which linears they take, that the model's
outputs stay the model's, that leaving restores the model, and the engine's tokens with and
without them."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.runner.packed_linears import PackedLinears
from tests.helpers import make_model, random_prompts, reference_tokens



@pytest.fixture(autouse=True, params=["cbk", "onednn"])
def packed_backend(request, monkeypatch):
    """Every test runs on both packed backends (ours and oneDNN's)."""
    import cb_kernels.runner.packed_linears as pl

    monkeypatch.setattr(pl, "GEMM", request.param)
    if pl.gemm() != request.param:
        pytest.skip(f"the {request.param} packed backend does not run on this machine")
    return request.param


def _groups(packed):
    return sorted(tuple(m.out_features for m in g.members) for g in packed.groups)


def test_groups_siblings_that_read_one_input():
    model = make_model("qwen2")           # q/k/v with biases, gate/up without
    packed = PackedLinears.build(model, True)
    # Per layer: q/k/v fused (64 + 32 + 32), gate/up fused, o and down alone; plus the LM head.
    assert _groups(packed) == sorted([(64, 32, 32), (128, 128), (64,), (64,)] * 2 + [(500,)])


def test_builds_only_when_asked_and_for_cpu_fp32_or_bf16(monkeypatch):
    assert PackedLinears.build(make_model(), False) is None
    assert PackedLinears.build(make_model().to(torch.float16), True) is None
    bf16 = PackedLinears.build(make_model().to(torch.bfloat16), True)
    assert bf16 is not None and all(g.dtype == torch.bfloat16 for g in bf16.groups)
    assert PackedLinears.build(make_model(), "auto", 1 << 20) is None      # the copy would not fit
    monkeypatch.setattr("cb_kernels.engine.sizing.host_available_bytes", lambda: 1 << 20)
    assert Engine(make_model(), EngineConfig(num_blocks=8)).runner.packed is None
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
    """A monkeypatched forward may compute something else than the plain linear: it runs inside a
    step too (installed before the build: the linear is not packed; after it: not overridden)."""
    model = make_model()
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    calls = []

    def patch(lin, scale):
        def forward(x):
            calls.append(lin)
            return torch.nn.Linear.forward(lin, x) * scale
        lin.forward = forward
        return forward
    before = patch(mlp.down_proj, 2.0)
    packed = PackedLinears.build(model, True)
    assert all(mlp.down_proj not in g.members for g in packed.groups)
    after = patch(attn.k_proj, 3.0)          # k_proj is packed with q and v
    x, h = torch.randn(2, 64), torch.randn(2, 128)
    with torch.no_grad():
        with packed:
            assert mlp.down_proj.forward is before and attn.k_proj.forward is after
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            down = mlp.down_proj(h)
        assert calls == [attn.k_proj, mlp.down_proj]
        torch.testing.assert_close(k, 3 * (x @ attn.k_proj.weight.t()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, x @ attn.v_proj.weight.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(down, 2 * (h @ mlp.down_proj.weight.t()), rtol=1e-5, atol=1e-5)
    assert mlp.down_proj.forward is before and attn.k_proj.forward is after
    assert "forward" not in attn.q_proj.__dict__ and "forward" not in attn.v_proj.__dict__


def test_nested_entries_and_an_exception_restore_the_model():
    model = make_model()
    first, second = PackedLinears.build(model, True), PackedLinears.build(model, True)
    with first:
        with first:                    # re-entered: installs nothing, leaves nothing behind
            pass
        assert all("forward" in m.__dict__ for g in first.groups for m in g.members)
        with second:                   # another instance on the same model, nested
            pass
        assert all(m.forward == g.forwards[i] for g in first.groups
                   for i, m in enumerate(g.members))
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(RuntimeError, match="in the middle"):
        with torch.no_grad(), first:
            model.model.layers[0].self_attn.q_proj(torch.randn(2, 64))   # caches q/k/v
            raise RuntimeError("in the middle of a step")
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(g.last_input is None for g in first.groups)


@pytest.mark.one_thread
def test_one_module_in_two_sibling_places_is_not_fused():
    model = make_model()
    attn = model.model.layers[0].self_attn
    attn.v_proj = attn.k_proj                 # tied k/v: one module, two names
    packed = PackedLinears.build(model, True)
    assert not any(attn.q_proj in g.members and len(g.members) > 1 for g in packed.groups)
    ids = torch.randint(0, 500, (1, 9))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        with packed:
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.one_thread
def test_refresh_force_sees_writes_through_data():
    model = make_model()
    lin = model.model.layers[1].mlp.down_proj
    packed = PackedLinears.build(model, True)
    h = torch.randn(3, 128)
    with torch.no_grad():
        with packed:
            lin(h)
        lin.weight.data.mul_(3)               # no version bump: not seen on entry
        packed.refresh(force=True)
        with packed:
            got = lin(h)
    torch.testing.assert_close(got, h @ lin.weight.t(), rtol=1e-5, atol=1e-5)


def test_data_assignment_is_seen_even_at_the_same_size():
    """`w.data = new` keeps the version counter; the new storage must not be mistaken for the
    old one when the allocator hands out the freed address again (glibc does for this pattern,
    a 768 KB block freed, then 1.5 MB, then 768 KB, in a fresh process: without the held storage
    the packed output was off by 31 there; inside a long pytest run reuse is not certain)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 3000))
    lin = model[0]
    packed = PackedLinears.build(model, True)
    h = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(3):
            with packed:
                lin(h)
            shape = lin.weight.shape
            lin.weight.data = torch.randn(shape, dtype=torch.float64)
            lin.weight.data = torch.randn(shape)
            with packed:
                got = lin(h)
            torch.testing.assert_close(got, h @ lin.weight.t() + lin.bias, rtol=1e-5, atol=1e-5)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="pack_weights"):
        EngineConfig(pack_weights="yes")


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.one_thread
def test_engine_tokens_equal_generate_either_way(pack):
    model = make_model()
    prompts = random_prompts([5, 17, 40, 9], seed=3)
    engine = Engine(model, EngineConfig(pack_weights=pack))
    assert (engine.runner.packed is not None) == pack
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(model, prompts, 12)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_backend_setting_is_checked(monkeypatch):
    import cb_kernels.runner.packed_linears as pl

    monkeypatch.setattr(pl, "GEMM", "mkl")
    with pytest.raises(ValueError, match="GEMM must be one of"):
        pl.gemm()
