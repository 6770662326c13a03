"""generate and stream over many prompts, built only on the Engine's public request API
(check_request, add_request, step, reject, sequence, defer); Engine.generate/stream call them.
Frontend: one request's stream deltas (stream() and the server's streaming use it)."""
from __future__ import annotations

from typing import Iterator, Optional

from cb_kernels.engine import requests
from cb_kernels.engine.config import RequestOutput
from cb_kernels.engine.detokenizer import IncrementalDetokenizer
from cb_kernels.engine.sequence import Sequence


def _add_all(engine, prompts, params) -> list:
    """Add every prompt; a bad one becomes an "error" output instead of stopping the rest.
    Returns one entry per prompt: a request id, or the finished error output. Every prompt
    is checked before any is queued, so an exception out of here leaves nothing queued."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError("prompts must be a list of prompts (token-id lists or strings), got "
                        f"{type(prompts).__name__}")
    prompts = list(prompts)
    if isinstance(params, (list, tuple)):
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        per_prompt = list(params)
    else:
        per_prompt = [params] * len(prompts)
    checked = []
    for prompt, p in zip(prompts, per_prompt):
        try:
            checked.append(engine.check_request(prompt, p))
        except (ValueError, TypeError) as e:
            checked.append(engine.reject(prompt, e))
    return [engine.add_request(*c) if isinstance(c, tuple) else c for c in checked]


def generate(engine, prompts, params=None) -> list:
    """Run `prompts` to completion; returns their RequestOutputs in prompt order. A prompt
    that add_request rejects gets an output with finish_reason "error" and the message."""
    entries = _add_all(engine, prompts, params)
    wanted = {e for e in entries if isinstance(e, str)}
    done, others = {}, []
    while wanted - done.keys():
        for out in engine.step():
            if out.request_id in wanted:
                done[out.request_id] = out
            else:
                others.append(out)
    engine.defer(others)   # requests added by add_request() still reach step()'s caller
    return [done[e] if isinstance(e, str) else e for e in entries]


def stream(engine, prompts, params=None) -> Iterator[RequestOutput]:
    """Yield, after each step, one RequestOutput per request that got new tokens, holding
    only those tokens (and their text); the last one of a request has its finish_reason."""
    entries = _add_all(engine, prompts, params)
    for e in entries:
        if not isinstance(e, str):
            yield e
    live = {e: engine.sequence(e) for e in entries if isinstance(e, str)}
    others = []
    while live:
        ended = set()
        for out in engine.step():
            (ended.add(out.request_id) if out.request_id in live else others.append(out))
        for rid, seq in list(live.items()):
            yield from engine.frontend.deltas(seq, rid in ended)
            if rid in ended:
                del live[rid]
    engine.defer(others)


class Frontend:
    """The stream deltas of requests, text decoded with `tokenizer` (None: token ids only)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.weight_version = 0       # the Engine's, stamped on each delta

    def deltas(self, seq: Sequence, ended: bool) -> list:
        """The stream deltas of one request since the last call (what stream() yields for it
        after a step): `seq` is the request's Sequence as add_request left it, `ended` whether
        step() just returned its output. n > 1: one delta per sample with news, outputs[0].index
        says which."""
        if seq.group is None:
            delta = self._delta(seq, ended)
            return [] if delta is None else [delta]
        deltas = (self._delta(sample, sample.is_finished) for sample in seq.group.samples)
        return [d for d in deltas if d is not None]

    def _delta(self, seq: Sequence, final: bool) -> Optional[RequestOutput]:
        """The delta of one sample since its last one (None when there is nothing new);
        `final`: it ended, this is its last delta (num_streamed_tokens becomes -1)."""
        if seq.num_streamed_tokens < 0:
            return None
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_streamed_tokens:]
        if not new and not final:
            return None
        text = self._text_delta(seq, final)
        seq.num_streamed_tokens = -1 if final else seq.num_streamed_tokens + len(new)
        delta = requests.delta_of(seq, new, self.tokenizer, text)
        delta.weight_version = self.weight_version
        return delta

    def _text_delta(self, seq: Sequence, final: bool = False) -> Optional[str]:
        """New text since the last delta. Mid-stream the request's IncrementalDetokenizer gives
        it (created here for a request without stop strings: O(1) a token, where decoding all
        output tokens each step cost O(length)); its last delta comes from decoding all output
        tokens, so the stream's text adds up to what a full decode gives."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        det = seq.detokenizer
        if det is not None and det.stop:     # stop strings: hold back a possible match's start
            full = det.text if final else det.stream_text()
        elif final:
            full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        else:
            if det is None:
                det = seq.detokenizer = IncrementalDetokenizer(tokenizer)
            det.append(seq.token_ids[seq.num_prompt_tokens:], check=False)
            full = det.text
        sent, seq.streamed_text = seq.streamed_text, full
        return full[len(sent):] if full.startswith(sent) else full
