"""Every sampled row is drawn by ops.sample_tokens, whichever path the sampler takes for it: a
temperature-only row from its raw logits in one pass (the GRPO path), a filtered row through
filter_logits, a small top_k among its candidates. A row's token and processed logprob are the
same bits on every path and next to any neighbours."""
import pytest
import torch

from cb_kernels import SamplingParams
from cb_kernels.engine import sampler
from cb_kernels.engine.sampler import Sampler
from cb_kernels.engine.sequence import Sequence

pytestmark = pytest.mark.one_thread
VOCAB = 3000


def seqs_for(params: list) -> list:
    out = []
    for i, p in enumerate(params):
        seq = Sequence(i, f"r{i}", [1, 2, 3], p, eos_token_ids=frozenset([5]))
        seq.token_ids += [7] * (i % 4)            # different positions: different uniforms
        out.append(seq)
    return out


def run(logits: torch.Tensor, params: list) -> tuple:
    """(tokens, the processed (entry, logprob) of each row) of one sampler step."""
    seqs = seqs_for(params)
    tokens = Sampler(seed=0)._sample(logits.clone(), seqs, seqs)
    return tokens, [(s.logprobs[-1], s.cumulative_logprob) if s.logprobs else None for s in seqs]


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


@pytest.mark.parametrize("k", [0, 3])
def test_the_one_pass_path_gives_the_filter_paths_bits(monkeypatch, k):
    """Temperature-only rows (some at 1): drawn from the raw rows by one sample_tokens call, or
    (forced) through filter_logits and draw: the same tokens, logprobs and top-k entries."""
    params = [SamplingParams(temperature=t, seed=s, logprobs=k, logprobs_mode="processed")
              for s, t in enumerate([1.0, 0.7, 1.3, 1.0, 0.45, 2.0] * 4)]
    logits = logits_for(len(params))
    fast = run(logits, params)
    calls = []
    real = sampler.sample_rows
    monkeypatch.setattr(sampler, "_plain", lambda p, vocab: False)
    monkeypatch.setattr(sampler, "sample_rows", lambda *a: calls.append(1) or real(*a))
    slow = run(logits, params)
    assert calls, "the forced run did not take the filter path"
    assert fast == slow
    assert all(len(entry) in ((1,) if k == 0 else (3, 4)) for entry, _ in fast[1])


def test_a_rows_logprob_does_not_depend_on_its_neighbours():
    """A processed row alone (one-pass path), next to a greedy processed row and next to a
    filtered row (both send the batch's logprobs through the general path): the same bits."""
    mine = SamplingParams(temperature=0.8, seed=9, logprobs=2, logprobs_mode="processed")
    greedy = SamplingParams(temperature=0.0, logprobs=1, logprobs_mode="processed")
    filtered = SamplingParams(temperature=1.1, top_p=0.9, seed=3, logprobs=0,
                              logprobs_mode="processed")
    logits = logits_for(2, seed=5)
    alone = run(logits[:1], [mine])
    for other in (greedy, filtered):
        crowd = run(logits, [mine, other])
        assert crowd[0][0] == alone[0][0] and crowd[1][0] == alone[1][0]


def test_top_k_candidates_and_whole_vocabulary_draw_alike():
    """Rows with only 40 finite logits: top_k=40 (drawn among the candidates) and top_k=0 (the
    one-pass path over the vocabulary) give the same token for every seed."""
    g = torch.Generator().manual_seed(7)
    logits = torch.full((64, VOCAB), -float("inf"))
    for r in range(64):
        logits[r, torch.randperm(VOCAB, generator=g)[:40]] = torch.randn(40, generator=g) * 2
    few = [SamplingParams(temperature=0.9, top_k=40, seed=s) for s in range(64)]
    whole = [SamplingParams(temperature=0.9, seed=s) for s in range(64)]
    assert 40 <= sampler.MAX_CANDIDATES
    got_few, got_whole = run(logits, few)[0], run(logits, whole)[0]
    assert got_few == got_whole
    assert len(set(got_whole)) > 32           # the seeds spread over the candidates
