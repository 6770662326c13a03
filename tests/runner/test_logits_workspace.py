"""runner/lm_head.py's logits workspace: large logits are written into one buffer the head keeps,
reused only once no tensor from an earlier call holds it, so logits a caller keeps never change
and the engine's sampled tokens are the same with or without it."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.ops import PackedLinear
from cb_kernels.runner import lm_head
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens, run_checked


def _head(vocab: int = 300, hidden: int = 48):
    module = torch.nn.Linear(hidden, vocab, bias=False)
    lin = PackedLinear(module.weight.detach())

    def run(rows, out=None):
        return lin.run_unchecked(rows, out=out)
    run.takes_out = True
    return lm_head.LogitsHead(run, module), module


def test_kept_logits_never_change_and_a_free_workspace_is_reused(monkeypatch):
    monkeypatch.setattr(lm_head, "WORKSPACE_MIN_BYTES", 0)
    head, module = _head()
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(20, 48, generator=g), torch.randn(20, 48, generator=g)
    want1, want2 = x1 @ module.weight.detach().T, x2 @ module.weight.detach().T
    a = head.logits(x1)
    first = head._workspace.data_ptr()
    b = head.logits(x2)              # `a` is held: a new workspace
    assert head._workspace.data_ptr() != first
    torch.testing.assert_close(a, want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, want2, rtol=1e-5, atol=1e-5)
    second = head._workspace.data_ptr()
    view = b[:3]
    del a, b
    c = head.logits(x1)              # a view of the last one is still held
    assert head._workspace.data_ptr() != second
    torch.testing.assert_close(view, want2[:3], rtol=1e-5, atol=1e-5)
    third = head._workspace.data_ptr()
    del c, view
    d = head.logits(x2[:11])         # nothing held, fewer rows: the same buffer
    assert head._workspace.data_ptr() == third and d.shape == (11, 300)
    torch.testing.assert_close(d, want2[:11], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("low, high, used", [(0, 1 << 40, True), (1 << 40, 1 << 41, False),
                                             (0, 100, False)],
                         ids=["in-range", "below-min", "above-cap"])
def test_only_logits_between_the_bounds_use_it(monkeypatch, low, high, used):
    monkeypatch.setattr(lm_head, "WORKSPACE_MIN_BYTES", low)
    monkeypatch.setattr(lm_head, "WORKSPACE_MAX_BYTES", high)
    head, _ = _head()
    head.logits(torch.randn(4, 48))
    assert (head._workspace is not None) == used


def test_a_run_without_out_is_called_as_before(monkeypatch):
    monkeypatch.setattr(lm_head, "WORKSPACE_MIN_BYTES", 0)
    module = torch.nn.Linear(16, 40, bias=False)
    head = lm_head.LogitsHead(module, module)       # the module itself: no `out`
    x = torch.randn(3, 16)
    assert torch.equal(head.logits(x), module(x).float()) and head._workspace is None


@pytest.mark.one_thread
def test_engine_tokens_are_the_same_with_the_workspace(monkeypatch):
    """Seeded sampling with logprobs and greedy requests, n > 1: the same tokens and logprobs with
    every logits tensor in the workspace as without it; greedy ones equal generate's."""
    model = make_model("llama")
    prompts = random_prompts([9, 30, 4, 17], seed=2)

    def run():
        engine = Engine(model, EngineConfig(attention_backend=ATTN_BACKEND, block_size=8,
                                            num_blocks=64, greedy_head=False))
        params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, n=3, logprobs=0,
                                 logprobs_mode="processed"),
                  SamplingParams(max_new_tokens=10),
                  SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, logprobs=2),
                  SamplingParams(max_new_tokens=10)]
        ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
        outs = run_checked(engine)
        return [[(o.token_ids, o.logprobs) for o in outs[i].outputs] for i in ids], engine

    off, _ = run()
    monkeypatch.setattr(lm_head, "WORKSPACE_MIN_BYTES", 0)
    on, engine = run()
    assert on == off
    if getattr(engine.runner.head.run, "takes_out", False):
        assert engine.runner.head._workspace is not None
    want = reference_tokens(model, [prompts[1], prompts[3]], 10)
    assert [on[1][0][0], on[3][0][0]] == want
