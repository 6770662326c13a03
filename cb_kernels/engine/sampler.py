"""Next-token choice for the sequences of one step, as batched tensor work over the whole step.

The logits rows of a step go through, for every row at once (rows whose request does not use a
feature get its neutral value, so one tensor op serves the batch):
  logit_bias (added) -> min_new_tokens (EOS and stop ids masked) -> repetition_penalty
  (transformers' rule over prompt and output tokens) -> frequency / presence penalty (OpenAI's,
  over output tokens) -> greedy rows: argmax; sampled rows: temperature -> min_p -> top_k ->
  top_p -> one draw.
The draw is an inverse-CDF lookup with one uniform per row. That uniform is a counter-based hash
(splitmix64) of the sample's seed and the token's position, computed on the device for all rows
together: a sample's tokens depend only on its seed and position, never on its batch neighbours,
on preemption or on how many draws came before, and no per-request generator call is needed.
Every filter keeps the most likely token and the temperature is applied after subtracting the
row's maximum, so any accepted value gives a valid distribution (never inf or NaN).

Logprobs (logprobs=k, prompt_logprobs=k) are the log-softmax of the raw fp32 logits, computed only
for the rows of requests that asked. A request with n > 1 samples draws its n first tokens from
the one logits row of its prompt's last position (engine.py then forks the other samples).
"""
from __future__ import annotations

from array import array
from typing import Optional

import torch

from cb_kernels.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def sample_seed(base: int, index: int) -> int:
    """The seed of sample `index` of a request whose seed is `base` (any int in [0, 2**64))."""
    x = torch.tensor([_signed(base), _signed(index * 0xD1B54A32D192ED03)], dtype=torch.int64)
    return int(mix64(x[:1] ^ mix64(x[1:]))[0])


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row: fp32, from int64 seeds and positions [num_rows]."""
    z = mix64(seeds ^ mix64(positions))
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _ids(values, device) -> torch.Tensor:
    return torch.frombuffer(values, dtype=torch.int64).to(device) if len(values) else \
        torch.empty(0, dtype=torch.int64, device=device)


def _token_counts(seqs: list, outputs_only: bool, vocab_size: int, device) -> torch.Tensor:
    """How often each token occurs in each of `seqs` (prompt + output, or output only):
    fp32 [len(seqs), vocab_size]."""
    flat, lengths = array("q"), []
    for s in seqs:
        tokens = s.output_token_ids if outputs_only else s.token_ids
        flat.extend(tokens)
        lengths.append(len(tokens))
    counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32, device=device)
    if len(flat):
        rows = torch.repeat_interleave(torch.arange(len(seqs), device=device),
                                       torch.tensor(lengths, device=device))
        counts.index_put_((rows, _ids(flat, device)),
                          torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _column(values: list, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def change_logits(x: torch.Tensor, seqs: list) -> torch.Tensor:
    """x: fp32 [num_rows, vocab_size], row i for seqs[i] (a Sequence whose next token it is).
    Applies logit_bias, the min_new_tokens mask and the penalties, in place; returns x."""
    device, vocab = x.device, x.shape[1]
    params = [s.params for s in seqs]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        rows, cols, vals = [], [], []
        for i in biased:
            b = params[i].logit_bias
            rows += [i] * len(b)
            cols += b.keys()
            vals += b.values()
        x.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                     torch.tensor(vals, dtype=x.dtype, device=device), accumulate=True)
    young = [i for i, (s, p) in enumerate(zip(seqs, params))
             if s.num_generated_tokens < p.min_new_tokens]
    if young:
        rows, cols = [], []
        for i in young:
            banned = set(params[i].stop_token_ids)
            if not params[i].ignore_eos:
                banned |= seqs[i].eos_token_ids
            banned = [t for t in banned if t < vocab]
            rows += [i] * len(banned)
            cols += banned
        if rows:
            x[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = -float("inf")
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        idx = torch.tensor(rep, device=device)
        seen = _token_counts([seqs[i] for i in rep], False, vocab, device) > 0
        penalty = _column([params[i].repetition_penalty for i in rep], device)
        sub = x.index_select(0, idx)
        sub = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
        x.index_copy_(0, idx, sub)
    pen = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if pen:
        idx = torch.tensor(pen, device=device)
        counts = _token_counts([seqs[i] for i in pen], True, vocab, device)
        freq = _column([params[i].frequency_penalty for i in pen], device)
        pres = _column([params[i].presence_penalty for i in pen], device)
        x.index_copy_(0, idx, x.index_select(0, idx) - freq * counts - pres * (counts > 0))
    return x


def filter_logits(y: torch.Tensor, params: list) -> torch.Tensor:
    """y: fp32 [num_rows, vocab_size] of sampled rows. Temperature (after subtracting the row's
    maximum: any temperature the checks accept gives finite or -inf values, never NaN), min_p,
    top_k, top_p; each keeps at least the most likely token. Returns the filtered logits."""
    device, vocab = y.device, y.shape[1]
    y = (y - y.amax(-1, keepdim=True)) / _column([p.temperature for p in params], device)
    min_p = [p.min_p for p in params]
    if any(min_p):
        # min_p * top probability, in logits: top - log(1 / min_p); the top is 0 after the shift.
        floor = torch.log(_column(min_p, device))
        y = y.masked_fill(y < floor, -float("inf"))
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]      # 0: no top-k
    k_max = max(ks)
    if k_max:
        k = _column(ks, device, torch.int64)
        kth = torch.topk(y, k_max, dim=-1).values.gather(1, k.clamp(min=1) - 1)
        y = y.masked_fill((y < kth) & (k > 0), -float("inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        idx = torch.tensor(nucleus, device=device)
        sub = y.index_select(0, idx)
        ordered = torch.sort(sub, dim=-1, descending=True).values
        probs = ordered.softmax(-1)
        top_p = _column([params[i].top_p for i in nucleus], device)
        drop = probs.cumsum(-1) - probs >= top_p   # mass before the token already reaches top_p
        drop[:, 0] = False
        last = ordered.gather(1, (~drop).sum(-1, keepdim=True) - 1)
        y = y.index_copy(0, idx, sub.masked_fill(sub < last, -float("inf")))
    return y


def draw(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of filtered logits y [num_rows, vocab_size] from uniforms u
    [num_rows]: int64 [num_rows]."""
    probs = y.softmax(-1)
    cum = probs.cumsum(-1)
    target = (u * cum[:, -1])[:, None]
    tokens = torch.searchsorted(cum, target, right=True).clamp_(max=y.shape[1] - 1)
    # fp32 rounding can land the target past the last token of mass; the argmax is then right.
    empty = probs.gather(1, tokens) <= 0
    return torch.where(empty, probs.argmax(-1, keepdim=True), tokens)[:, 0]


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list) -> list:
    """logprobs: fp32 [num_rows, vocab_size] (log-softmax); chosen: int64 [num_rows]; ks[i]: how
    many of the most likely tokens row i reports. Returns per row (dict id -> logprob holding the
    top ks[i] and the chosen token, the chosen token's logprob)."""
    chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    k_max = max(ks)
    if k_max:
        values, ids = torch.topk(logprobs, k_max, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for i, (k, c, lp) in enumerate(zip(ks, chosen.tolist(), chosen_lp)):
        entry = dict(zip(ids[i][:k], values[i][:k])) if k else {}
        entry[c] = lp
        out.append((entry, lp))
    return out


class Sampler:
    """Picks the next token of every sampled row of a step (and records logprobs).

    `seed` seeds the draw of a base seed for requests that have none (so an unseeded request is
    reproducible given the engine's seed and the order requests arrive in)."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def seed_of(self, seq: Sequence) -> int:
        if seq.sample_seed is None:
            group = seq.group
            base = group.base_seed if group is not None else None
            if base is None:
                base = seq.params.seed
                if base is None:
                    base = int(torch.randint(0, 1 << 62, (1,), generator=self.generator))
                if group is not None:
                    group.base_seed = base
            seq.sample_seed = sample_seed(base, seq.sample_index)
        return seq.sample_seed

    def __call__(self, logits: torch.Tensor, seqs: list, prompt_rows: Optional[list] = None) -> list:
        """logits: fp32 [num_rows, vocab_size]; row i < len(seqs) for seqs[i]'s next token, the
        rows after them for `prompt_rows` (see prompt_rows()). Returns one token id per seq."""
        if prompt_rows:
            self._prompt_logprobs(logits[len(seqs):], prompt_rows)
        if not seqs:
            return []
        rows = logits[:len(seqs)].float()
        forks = [i for i, s in enumerate(seqs) if s.group is not None and s.group.forks_now(s)]
        items, src, index = list(seqs), list(seqs), list(range(len(seqs)))
        for i in forks:        # the other samples' first tokens come from the same row
            root = seqs[i]
            for j in range(1, root.params.n):
                items.append(root.group.new_sample(root, j))
                src.append(root)
                index.append(i)
        if forks:
            rows = rows.index_select(0, torch.tensor(index, device=rows.device))
        params = [s.params for s in items]
        asks = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = rows.index_select(0, torch.tensor(asks, device=rows.device)).log_softmax(-1) \
            if asks else None
        x = rows
        if any(p.changes_logits for p in params):
            x = change_logits(rows.clone(), src)
        tokens = x.argmax(-1)
        drawn = [i for i, p in enumerate(params) if p.sampling]
        if drawn:
            idx = torch.tensor(drawn, device=x.device)
            seeds = torch.tensor([self.seed_of(items[i]) for i in drawn], dtype=torch.int64)
            positions = torch.tensor([items[i].num_generated_tokens for i in drawn],
                                     dtype=torch.int64)
            u = uniforms(seeds, positions).to(x.device)
            y = filter_logits(x.index_select(0, idx), [params[i] for i in drawn])
            tokens = tokens.index_copy(0, idx, draw(y, u))
        if asks:
            chosen = tokens.index_select(0, torch.tensor(asks, device=tokens.device))
            for i, (entry, lp) in zip(asks, top_logprobs(raw, chosen,
                                                         [params[i].logprobs for i in asks])):
                items[i].record_logprob(entry, lp)
        tokens = tokens.tolist()
        for k in range(len(seqs), len(items)):
            items[k].token_ids.append(tokens[k])
        return tokens[:len(seqs)]

    # -- prompt logprobs ------------------------------------------------------------------------
    @staticmethod
    def prompt_rows(batch, logits_indices: torch.Tensor) -> tuple:
        """For the requests of `batch` that want prompt logprobs (batch.prompt_logprobs, indices
        into batch.seqs): the logits rows of their prompt positions in this step. Returns
        (logits_indices with those rows appended, [(seq, first position, count)]); positions are
        those whose next token is a prompt token not yet scored."""
        starts, offset = [], 0
        for n in batch.num_new_tokens:
            starts.append(offset)
            offset += n
        extra, rows = [], []
        for i in batch.prompt_logprobs:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            begin = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if end > begin:
                first = starts[i] + begin - seq.num_computed_tokens
                extra.extend(range(first, first + end - begin))
                rows.append((seq, begin, end - begin))
        if not extra:
            return logits_indices, []
        extra = torch.tensor(extra, dtype=torch.int64).to(logits_indices.device)
        return torch.cat([logits_indices, extra]), rows

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list) -> None:
        """logits: fp32 [sum of counts, vocab_size], the prompt rows of `rows` in order."""
        targets, ks = [], []
        for seq, begin, count in rows:
            targets += seq.token_ids[begin + 1:begin + 1 + count]
            ks += [seq.params.prompt_logprobs] * count
        chosen = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        entries = top_logprobs(logits.float().log_softmax(-1), chosen, ks)
        k = 0
        for seq, begin, count in rows:
            if len(seq.prompt_logprobs) == begin + 1:     # else scored already (a rerun)
                seq.prompt_logprobs.extend(e for e, _ in entries[k:k + count])
            k += count
