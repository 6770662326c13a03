"""Next-token choice for the sequences of one step, as batched tensor work over the whole step.

The logits rows of a step go through, for every row at once (rows whose request does not use a
feature get its neutral value, so one tensor op serves the batch):
  logit_bias (added) -> min_new_tokens (EOS and stop ids masked) -> repetition_penalty
  (transformers' rule over prompt and output tokens) -> frequency / presence penalty (OpenAI's,
  over output tokens) -> greedy rows: argmax; sampled rows: temperature -> min_p -> top_k ->
  top_p -> one draw.
The draw is an inverse-CDF lookup with one uniform per row, made by ops.sample_tokens over the
integer masses trunc(exp(y) * 2^40) of the filtered logits y, summed exactly: a row gets the same
token among its top-k candidates as over the whole vocabulary, and a temperature-only row (no
min_p, top_k, top_p) is drawn in one pass from its raw logits with the same bits as filter_logits
then the draw. The uniform is a counter-based hash (splitmix64) of the sample's seed and the
token's position, computed on the device for all rows together: a sample's tokens depend only
on its seed and position, never on its batch neighbours, on preemption or on how many draws came
before, and no per-request generator call is needed.
Every filter keeps the most likely token and the temperature is applied after subtracting the
row's maximum, so any accepted value gives a valid distribution (never inf or NaN).

Rows whose request has structured output (engine/structured.py) get, after the penalties, the
tokens their grammar does not allow next set to -inf: one bitmask fill for all of them, the
other rows untouched; after the choice each grammar takes its row's token.

Logprobs (logprobs=k, prompt_logprobs=k) are the log-softmax of the raw fp32 logits, computed only
for the rows of requests that asked; with SamplingParams.logprobs_mode="processed" a generated
token's logprobs are those of the distribution it was drawn from instead (vLLM's
processed_logprobs): after bias, min_new_tokens and the penalties, and for sampled rows after
temperature, min_p, top_k and top_p (a token they removed has logprob -inf); y minus
sample_tokens' logsumexp, whichever path drew the row (the same bits next to any neighbours).
A request with n > 1 samples draws its n first tokens from the one logits row of its prompt's
last position (engine.py then forks the other samples).
"""
from __future__ import annotations

from array import array
from typing import Optional

import torch

from cb_kernels.engine import structured
from cb_kernels.engine.sequence import Sequence
from cb_kernels.ops.sample_tokens import sample_tokens_unchecked

_MASK64 = (1 << 64) - 1
_FP32_MAX = torch.finfo(torch.float32).max


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


def _flat_tokens(seqs: list, rows: list, outputs_only: bool, device):
    """(row index, token id) int64 pairs [num_tokens] of the tokens of seqs[i] for i in `rows`
    (prompt + output, or output only): one gather/scatter over them replaces a [rows, vocab]
    pass."""
    flat, lengths = array("q"), []
    for i in rows:
        s = seqs[i]
        tokens = s.token_ids[s.num_prompt_tokens:] if outputs_only else s.token_ids
        flat.extend(tokens)
        lengths.append(len(tokens))
    ids = torch.frombuffer(flat, dtype=torch.int64).to(device) if len(flat) else \
        torch.empty(0, dtype=torch.int64, device=device)
    row = torch.repeat_interleave(torch.tensor(rows, device=device),
                                  torch.tensor(lengths, device=device))
    return row, ids


def _subset(x: torch.Tensor, rows: list) -> torch.Tensor:
    """x[rows] without a copy when `rows` is every row (the common case: copying a
    [256, 49152] fp32 block took 60-110 ms on the 2-core dev box)."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[num_rows, 1] logsumexp of x [num_rows, vocab_size] (fp32). Read off log_softmax, whose
    fused kernel took 82 ms for 256 x 49152 where torch.logsumexp took 132 ms (2-core dev box,
    torch 2.13 CPU); both within 1 ulp."""
    return x[:, :1] - x.log_softmax(-1)[:, :1]


def _column(values: list, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def change_logits(x: torch.Tensor, seqs: list, undo: Optional[list] = None) -> torch.Tensor:
    """x: fp32 [num_rows, vocab_size], row i for seqs[i] (a Sequence whose next token it is).
    Applies logit_bias, the min_new_tokens mask and the penalties, in place; returns x. The work
    is proportional to the tokens involved (gathers and scatters at their ids), not to
    num_rows x vocab_size. `undo` (a list) gets (rows, ids, old values) before each change:
    writing them back in reverse order restores x. A value pushed past fp32's range by an
    extreme bias or penalty becomes the largest finite one (+inf would turn the temperature
    step's x - max into NaN); -inf stays (a masked token)."""
    touched = []

    def save(row, ids):
        touched.append((row, ids))
        if undo is not None:
            undo.append((row, ids, x[row, ids]))

    device, vocab = x.device, x.shape[1]
    params = [s.params for s in seqs]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        rows, cols, vals = [], [], []
        for i in biased:
            b = [(t, v) for t, v in params[i].logit_bias.items() if t < vocab]
            rows += [i] * len(b)
            cols += [t for t, _ in b]
            vals += [v for _, v in b]
        row = torch.tensor(rows, dtype=torch.int64, device=device)
        ids = torch.tensor(cols, dtype=torch.int64, device=device)
        save(row, ids)
        x.index_put_((row, ids), torch.tensor(vals, dtype=x.dtype, device=device),
                     accumulate=True)
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
            row, ids = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
            save(row, ids)
            x[row, ids] = -float("inf")
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        row, ids = _flat_tokens(seqs, rep, False, device)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[row]
        save(row, ids)
        score = x[row, ids]
        # A token seen twice is written twice with the same value: the rule applies once.
        x[row, ids] = torch.where(score < 0, score * penalty, score / penalty)
    pen = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if pen:
        row, ids = _flat_tokens(seqs, pen, True, device)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[row]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[row]
        save(row, ids)
        x[row, ids] = x[row, ids] - pres                     # once per distinct token
        x.index_put_((row, ids), -freq, accumulate=True)     # once per occurrence
    for row, ids in touched:
        x[row, ids] = x[row, ids].clamp(max=_FP32_MAX)
    return x


def filter_logits(y: torch.Tensor, params: list, ids: Optional[torch.Tensor] = None):
    """y: fp32 [num_rows, num_candidates] logits of sampled rows: the whole vocabulary, or (with
    `ids`, int64 [num_rows, num_candidates]) each row's top candidates sorted in descending
    order. Temperature (after subtracting the row's maximum: any temperature the checks accept
    gives finite or -inf values, never NaN), min_p, top_k, top_p; each keeps at least the most
    likely token. Returns the filtered logits, same shape."""
    device, width = y.device, y.shape[1]
    y = torch.sub(y, y.amax(-1, keepdim=True))       # a new tensor: `y` itself stays as it was
    temperature = [p.temperature for p in params]
    if any(t != 1 for t in temperature):
        y.div_(_column(temperature, device))
    min_p = [p.min_p for p in params]
    if any(min_p):
        # min_p * top probability, in logits: top - log(1 / min_p); the top is 0 after the shift.
        y = y.masked_fill(y < torch.log(_column(min_p, device)), -float("inf"))
    ks = [p.top_k if 0 < p.top_k < width else 0 for p in params]      # 0: no top-k
    k_max = max(ks)
    if k_max:
        k = _column(ks, device, torch.int64)
        if ids is None:
            kth = torch.topk(y, k_max, dim=-1).values.gather(1, k.clamp(min=1) - 1)
            y = y.masked_fill((y < kth) & (k > 0), -float("inf"))
        else:           # sorted candidates: top-k is a column mask
            cols = torch.arange(width, device=device)[None]
            y = y.masked_fill((cols >= k) & (k > 0), -float("inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        # Unnormalized masses (the top is exp(0) = 1): no sum over the row whose rounding could
        # depend on its width, so both paths of sample_rows decide alike.
        top_p = _column([p.top_p for p in params], device)
        ordered = y if ids is not None else torch.sort(y, dim=-1, descending=True).values
        mass = ordered.exp()
        cum = mass.cumsum(-1)
        drop = (cum - mass >= top_p * cum[:, -1:]) & (top_p < 1)   # mass before it reaches top_p
        drop[:, 0] = False
        if ids is not None:
            y = y.masked_fill(drop, -float("inf"))
        else:
            last = ordered.gather(1, (~drop).sum(-1, keepdim=True) - 1)
            y = y.masked_fill(y < last, -float("inf"))
    return y


def draw(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One column per row of filtered logits y [num_rows, num_candidates] (row maximum 0) from
    uniforms u [num_rows]: int64 [num_rows]. The inverse CDF over the masses exp(y) of
    ops.sample_tokens, whose sums are exact: columns of zero mass change nothing, so a row drawn
    among its top-k candidates or among the whole vocabulary (in the same column order) gets
    the same token, and so does a row that sample_tokens draws from its raw logits and
    temperature (_sample's plain path: the same y bit for bit)."""
    return sample_tokens_unchecked(y, u)[0]


def _plain(p, vocab: int) -> bool:
    """Whether a sampled row's filters are its temperature alone (no min_p, top_k, top_p)."""
    return not p.min_p and not 0 < p.top_k < vocab and p.top_p >= 1


def _temperatures(params: list, device) -> Optional[torch.Tensor]:
    """fp32 [num_rows] temperatures (as filter_logits divides by them), or None when all are 1."""
    temperature = [p.temperature for p in params]
    if all(t == 1 for t in temperature):
        return None
    return torch.tensor(temperature, dtype=torch.float32, device=device)


class _Top:
    """torch.topk's result shape (values, indices) for top_logprobs."""

    def __init__(self, values: torch.Tensor, indices: torch.Tensor):
        self.values, self.indices = values, indices


# Rows with a top_k of at most this are sampled among their top_k candidates only (a
# [rows, top_k] problem after one topk); the others over the whole vocabulary. The choice is per
# row (its own top_k), never per batch, so a row's token does not depend on its neighbours.
MAX_CANDIDATES = 1024


def sample_rows(x: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
    """x: fp32 [num_rows, vocab_size] (changed logits of sampled rows); u: uniforms [num_rows].
    Returns int64 token ids [num_rows]."""
    vocab, device = x.shape[1], x.device
    few = [i for i, p in enumerate(params) if 0 < p.top_k <= MAX_CANDIDATES and p.top_k < vocab]
    if not few:
        return draw(filter_logits(x, params), u)
    chosen = set(few)
    rest = [i for i in range(len(params)) if i not in chosen]
    pr = [params[i] for i in few]
    values, ids = torch.topk(_subset(x, few), max(p.top_k for p in pr), dim=-1)  # descending
    y = filter_logits(values, pr, ids)
    ids, perm = torch.sort(ids, dim=-1)          # token-id order, as over the whole vocabulary
    tokens = ids.gather(1, draw(y.gather(1, perm), u[few])[:, None])[:, 0]
    if not rest:
        return tokens
    out = torch.empty(len(params), dtype=torch.int64, device=device)
    out[torch.tensor(few, device=device)] = tokens
    out[torch.tensor(rest, device=device)] = draw(filter_logits(_subset(x, rest),
                                                                [params[i] for i in rest]),
                                                  u[rest])
    return out


def top_logprobs(chosen: torch.Tensor, chosen_lp: torch.Tensor, top, lse: torch.Tensor,
                 ks: list) -> list:
    """Per row (dict id -> logprob holding the top ks[i] and the chosen token, the chosen
    token's logprob). chosen: int64 [num_rows]; chosen_lp: fp32 [num_rows]; top: torch.topk of
    the raw logits [num_rows, max(ks)] (or None when max(ks) is 0); lse: their logsumexp
    [num_rows, 1]."""
    if top is not None:
        values, ids = (top.values - lse).tolist(), top.indices.tolist()
    out = []
    for i, (k, c, lp) in enumerate(zip(ks, chosen.tolist(), chosen_lp.tolist())):
        entry = dict(zip(ids[i][:k], values[i][:k])) if k else {}
        entry[c] = lp
        out.append((entry, lp))
    return out


class Sampler:
    """Picks the next token of every sampled row of a step (and records logprobs).

    `seed` seeds the draw of a base seed for requests that have none (so an unseeded request is
    reproducible given the engine's seed and the order requests arrive in)."""

    def __init__(self, seed: int = 0, grammars=None):
        self.generator = torch.Generator().manual_seed(seed)
        self.grammars = grammars       # structured.Grammars: masks the structured rows

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

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list,
                 prompt_rows: Optional[list] = None) -> list:
        """logits: fp32 [num_rows, vocab_size]; row i < len(seqs) for seqs[i]'s next token, the
        rows after them for `prompt_rows` (see prompt_rows()). Returns one token id per seq."""
        if prompt_rows:
            self._prompt_logprobs(logits[len(seqs):], prompt_rows)
        if not seqs:
            return []
        rows = logits[:len(seqs)].float()
        forks = [i for i, s in enumerate(seqs) if s.group is not None and s.group.forks_now(s)]
        # The other samples' first tokens come from their root's row. They are drawn in chunks
        # of at most the step's row count from one copy of the roots' raw rows, never one copy
        # of the logits per sample (256 prompts x n=128 would be 32,768 rows of the vocabulary).
        # Made before the roots are sampled: a sample starts as its root was before this step.
        extra = [(f, seqs[i].group.new_sample(seqs[i], j)) for f, i in enumerate(forks)
                 for j in range(1, seqs[i].params.n)]
        raw = rows[torch.tensor(forks, device=rows.device)] if forks else None
        tokens = self._sample(rows, list(seqs), list(seqs))
        step = len(seqs)
        for at in range(0, len(extra), step):
            part = extra[at:at + step]
            chunk = raw[torch.tensor([f for f, _ in part], device=rows.device)]
            samples = [s for _, s in part]
            for sample, token in zip(samples, self._sample(chunk, samples,
                                                           [seqs[forks[f]] for f, _ in part])):
                sample.token_ids.append(token)
        return tokens

    def _sample(self, rows: torch.Tensor, items: list, src: list) -> list:
        """One token id per row of `rows` (changed in place): items[i] is the sequence row i
        samples for, src[i] the one whose tokens its penalties count."""
        params = [s.params for s in items]
        asks = [i for i, p in enumerate(params)
                if p.logprobs is not None and p.logprobs_mode == "raw"]
        processed = [i for i, p in enumerate(params)
                     if p.logprobs is not None and p.logprobs_mode == "processed"]
        if asks:      # of the raw logits: logsumexp and the top k now, the chosen one's later
            ks = [params[i].logprobs for i in asks]
            raw = _subset(rows, asks)
            lse = _logsumexp(raw)
            top = torch.topk(raw, max(ks), dim=-1) if max(ks) else None
        # Changed in place (nothing else reads the step's logits); `undo` restores the raw
        # values where logprobs need them.
        undo = [] if asks else None
        if any(p.changes_logits for p in params):
            change_logits(rows, src, undo)
        guided = [i for i, s in enumerate(items) if s.grammar is not None]
        if guided:      # after change_logits: `undo` restores no token the mask blocked
            self.grammars.mask(rows, guided, [items[i].grammar for i in guided])
        drawn = [i for i, p in enumerate(params) if p.sampling]
        tokens = rows.argmax(-1) if len(drawn) < len(items) else None
        plain = None     # (logprobs, lse) of the drawn rows, when one sample_tokens drew them all
        if drawn:
            seeds = torch.tensor([self.seed_of(items[i]) for i in drawn], dtype=torch.int64)
            positions = torch.tensor([items[i].num_generated_tokens for i in drawn],
                                     dtype=torch.int64)
            u = uniforms(seeds, positions).to(rows.device)
            pd = [params[i] for i in drawn]
            if all(_plain(p, rows.shape[1]) for p in pd):
                # Temperature alone (a GRPO round): one pass per row draws the token and gives
                # its processed logprob, no [rows, vocab] temporary (ops/sample_tokens.py); the
                # same bits as filter_logits then draw.
                picked, lps, lses = sample_tokens_unchecked(_subset(rows, drawn), u,
                                                            _temperatures(pd, rows.device))
                plain = dict(zip(drawn, zip(lps.tolist(), lses.tolist())))
            else:
                picked = sample_rows(_subset(rows, drawn), pd, u)
            tokens = picked if tokens is None else \
                tokens.index_copy(0, torch.tensor(drawn, device=rows.device), picked)
        if processed:     # before `undo` gives the asking rows back their raw values
            entries = self._processed_logprobs(rows, params, processed, tokens, plain)
            for i, (entry, lp) in zip(processed, entries):
                items[i].record_logprob(entry, lp)
        if asks:
            for row, col, value in reversed(undo):
                rows[row, col] = value
            chosen = _subset(tokens[:, None], asks)
            chosen_lp = (_subset(rows, asks).gather(1, chosen) - lse)[:, 0]
            entries = top_logprobs(chosen[:, 0], chosen_lp, top, lse, ks)
            for i, (entry, lp) in zip(asks, entries):
                items[i].record_logprob(entry, lp)
        tokens = tokens.tolist()
        if guided:
            structured.consume([items[i].grammar for i in guided], [tokens[i] for i in guided])
        return tokens

    @staticmethod
    def _processed_logprobs(rows: torch.Tensor, params: list, processed: list,
                            tokens: torch.Tensor, plain: Optional[dict]) -> list:
        """(entry, logprob) per row of `processed`: of the distribution the row was drawn from
        (or its argmax taken over), y = its filtered logits (row maximum 0), with the logsumexp
        of ops.sample_tokens whichever path drew the row, so the logprob is the same bits for
        the same row in any batch. `plain`: row -> (logprob, lse) when sample_tokens drew the
        rows from the raw ones."""
        ks = [params[i].logprobs for i in processed]
        chosen = _subset(tokens[:, None], processed)
        if plain is not None and all(i in plain for i in processed):
            lp = torch.tensor([plain[i][0] for i in processed])
            lse = torch.tensor([plain[i][1] for i in processed])[:, None]
            top = None
            if max(ks):       # y = (x - max) / temperature of the top k, as the kernel's
                t = torch.topk(_subset(rows, processed), max(ks), dim=-1)
                y = t.values - t.values[:, :1]
                temps = _temperatures([params[i] for i in processed], rows.device)
                top = _Top(y / temps[:, None] if temps is not None else y, t.indices)
            return top_logprobs(chosen[:, 0], lp, top, lse.to(rows.device), ks)
        seen = _subset(rows, processed).clone()
        sampled = [k for k, i in enumerate(processed) if params[i].sampling]
        greedy = [k for k, i in enumerate(processed) if not params[i].sampling]
        if sampled:
            index = torch.tensor(sampled, device=rows.device)
            seen[index] = filter_logits(seen[index], [params[processed[k]] for k in sampled])
        if greedy:
            index = torch.tensor(greedy, device=rows.device)
            g = seen[index]
            seen[index] = g - g.amax(-1, keepdim=True)
        half = torch.full((len(processed),), 0.5, device=rows.device)
        lse = sample_tokens_unchecked(seen, half)[2][:, None]
        lp = (seen.gather(1, chosen) - lse)[:, 0]
        top = torch.topk(seen, max(ks), dim=-1) if max(ks) else None
        return top_logprobs(chosen[:, 0], lp, top, lse, ks)

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
        logits = logits.float()
        lse = _logsumexp(logits)
        chosen_lp = (logits.gather(1, chosen[:, None]) - lse)[:, 0]
        top = torch.topk(logits, max(ks), dim=-1) if max(ks) else None
        entries = top_logprobs(chosen, chosen_lp, top, lse, ks)
        k = 0
        for seq, begin, count in rows:
            if len(seq.prompt_logprobs) == begin + 1:     # else scored already (a rerun)
                seq.prompt_logprobs.extend(e for e, _ in entries[k:k + count])
            k += count
