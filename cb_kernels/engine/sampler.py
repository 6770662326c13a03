"""Next-token choice for the sequences of one step.

Greedy rows take the argmax of fp32 logits, as transformers' generate does. Sampled rows apply
temperature, then top-k, then top-p (nucleus) and draw from the request's own generator when it
has a seed (so its tokens do not depend on its batch neighbours), else from the engine's.
"""
from __future__ import annotations

import torch


def _sample_row(logits: torch.Tensor, params, generator) -> int:
    """logits: [vocab_size] fp32."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cum - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list) -> list:
        """logits: [num_seqs, vocab_size], row i for seqs[i]. Returns one token id per row."""
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        logits = logits.float().cpu()
        out = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if greedy[i]:
                continue
            if seq.generator is None and seq.params.seed is not None:
                seq.generator = torch.Generator().manual_seed(seq.params.seed)
            out[i] = _sample_row(logits[i], seq.params, seq.generator or self.generator)
        return out
