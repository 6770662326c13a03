"""The sampler draws n samples' first tokens without one copy of the logits per sample (issue
#28: 256 prompts x n=128 became 32,768 rows of the vocabulary, +8 GB): no tensor it samples from
has more rows than the step has sequences."""
from __future__ import annotations

import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.engine import sampler
from tests.helpers import make_model, random_prompts


def test_forked_samples_never_outnumber_the_step_rows(monkeypatch):
    seen = []              # (rows sampled from, sequences of the step) per call
    step_rows = []
    # Every draw goes through ops.sample_tokens (sample_rows' filtered rows and the plain ones).
    real_sample, real_call = sampler.sample_tokens_unchecked, sampler.Sampler.__call__

    def sample_tokens(x, u, temperature=None):
        seen.append((x.shape[0], step_rows[-1]))
        return real_sample(x, u, temperature)

    def call(self, logits, seqs, prompt_rows=None):
        step_rows.append(len(seqs))
        return real_call(self, logits, seqs, prompt_rows)

    monkeypatch.setattr(sampler, "sample_tokens_unchecked", sample_tokens)
    monkeypatch.setattr(sampler.Sampler, "__call__", call)
    torch.manual_seed(0)
    engine = Engine(make_model("llama"), EngineConfig(num_blocks=64, block_size=8,
                                                      cpu_offload_gib=0))
    prompts = random_prompts([9, 5], seed=3)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, n=24, seed=11, logprobs=2,
                            repetition_penalty=1.3)
    outs = engine.generate(prompts, params)
    assert step_rows[0] == 2 and seen[0] == (2, 2)      # the prefill step: 2 rows, 48 samples
    assert all(rows <= step for rows, step in seen), seen
    for out in outs:
        assert len(out.outputs) == 24 and all(len(c.token_ids) == 4 for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Each prompt alone (chunks of one row, not two): the same samples, logprobs included.
    for prompt, out in zip(prompts, outs):
        alone = Engine(make_model("llama"), EngineConfig(num_blocks=64, block_size=8,
                                                         cpu_offload_gib=0))
        (solo,) = alone.generate([prompt], params)
        assert [c.token_ids for c in solo.outputs] == [c.token_ids for c in out.outputs]
        assert [c.logprobs for c in solo.outputs] == [c.logprobs for c in out.outputs]
    assert engine.stats()["used_blocks"] == 0
