"""SamplingParams.logprobs_mode (issue 27): "raw" is the model's log-softmax, "processed" the
log-softmax of the distribution the token was picked from (vLLM's raw_logprobs /
processed_logprobs), each against plain torch on the model's own logits."""
import math

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, make_model, random_prompts

pytestmark = pytest.mark.one_thread
TOL = 1e-4          # fp32: the engine's paged forward against the model's own


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=11)


@torch.inference_mode()
def processed_reference(model, prompt, tokens, params) -> torch.Tensor:
    """Per generated token, the log-softmax it was drawn from: transformers' repetition rule over
    prompt + output so far, then temperature and top_k (sampled requests)."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()[len(prompt) - 1:]
    rows = []
    for t, row in enumerate(logits):
        row = row.clone()
        seen = torch.tensor(sorted(set(prompt + tokens[:t])))
        score = row[seen]
        row[seen] = torch.where(score < 0, score * params.repetition_penalty,
                                score / params.repetition_penalty)
        if params.sampling:
            row = row / params.temperature
            if params.top_k:
                kth = torch.topk(row, params.top_k).values[-1]
                row = row.masked_fill(row < kth, -float("inf"))
        rows.append(row.log_softmax(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (0.7, 20), (1.3, 2)])
def test_raw_and_processed_logprobs(llama, temperature, top_k):
    prompts = random_prompts([7, 12], seed=3)
    common = dict(max_new_tokens=6, temperature=temperature, top_k=top_k, seed=5, logprobs=4,
                  repetition_penalty=1.4)
    raw, processed = SamplingParams(**common), SamplingParams(**common, logprobs_mode="processed")
    engine = Engine(llama, EngineConfig(block_size=8, num_blocks=64,
                                        attention_backend=ATTN_BACKEND))
    outs = engine.generate(prompts + prompts, [raw, raw, processed, processed])
    for prompt, r, p in zip(prompts, outs[:2], outs[2:]):
        assert r.token_ids == p.token_ids            # the mode changes what is reported only
        tokens = r.token_ids
        want_raw = llama(torch.tensor([prompt + tokens[:-1]])).logits[0].float() \
            .log_softmax(-1)[len(prompt) - 1:].detach()
        want_proc = processed_reference(llama, prompt, tokens, processed)
        for got, want in ((r.outputs[0], want_raw), (p.outputs[0], want_proc)):
            for t, (token, entry) in enumerate(zip(tokens, got.logprobs)):
                assert len(entry) in (4, 5) and token in entry
                for tid, lp in entry.items():
                    w = want[t, tid].item()
                    assert (lp == w == -math.inf) or abs(lp - w) < TOL, (t, tid, lp, w)
        if top_k == 2:     # 2 tokens survive top_k: the other reported ones are -inf
            assert all(sum(math.isfinite(v) for v in e.values()) == 2 for e in p.outputs[0].logprobs)
        assert not any(math.isinf(v) for e in r.outputs[0].logprobs for v in e.values())
        # the repetition penalty (and temperature) make the two differ
        assert any(abs(p.outputs[0].logprobs[t][tok] - r.outputs[0].logprobs[t][tok]) > 1e-3
                   for t, tok in enumerate(tokens))


def test_logprobs_mode_is_checked():
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw', 'processed'\), "
                                         r"got 'processed_logprobs'"):
        SamplingParams(logprobs=1, logprobs_mode="processed_logprobs")
