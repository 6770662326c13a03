"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regex or one of
a list of strings (`SamplingParams(structured=StructuredOutput(...))`).

llguidance (the `[structured]` extra) turns the spec into a grammar over the tokenizer's
vocabulary and, each step, into a bitmask of the tokens that may come next. Picked over xgrammar
0.2.8 by measurement (SmolLM2's 49,152-token tokenizer, a 70-token answer to a 4-field schema,
AMD EPYC Zen 4 2 cores, load ~3): the mask of one row took 7 us (median) with either; 16 rows
97 us with llguidance (its thread pool) and 90 us with xgrammar. llguidance needs no other
package (xgrammar pulls transformers, triton and tvm-ffi) and bounds the work of one mask and of
one compile ("fuel"), so no schema a client sends can stall a step.

    Engine.check_request  Grammars.compile: the spec's grammar, checked (ValueError naming the
                          problem), cached per spec; a matcher in its start state is kept
    Engine.add_request    seq.grammar: a copy of that matcher
    Sampler               the rows with a grammar get their bitmasks in one call and their
                          disallowed logits set to -inf; after the draw each consumes its token
    Sequence.check_stop   "stop" once the grammar can take no more tokens

JSON is generated without free whitespace (`{"a":1}`), so a finished value ends the request at
once; strings inside it may hold any text the schema allows.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

INSTALL_HINT = "pip install 'cb_kernels[structured]'"
CACHE_SIZE = 256          # compiled specs kept per engine (each holds a matcher in start state)
MAX_ERROR_CHARS = 500


@dataclass
class StructuredOutput:
    """What a request's output must be; set exactly one of:

    json_schema: a JSON schema (dict, JSON text, or a pydantic model class);
    json_object: True for any JSON object (OpenAI's response_format json_object);
    regex: the whole output matches this regex (Rust regex syntax);
    choice: the output is exactly one of these strings.
    """

    json_schema: object = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list] = None

    def __post_init__(self) -> None:
        self.validate()

    def __getstate__(self) -> dict:
        # The compiled matcher (Grammars.compile) stays behind: it belongs to one engine.
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    def validate(self) -> None:
        set_fields = [name for name in ("json_schema", "json_object", "regex", "choice")
                      if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("StructuredOutput takes exactly one of json_schema, json_object, "
                             f"regex, choice; got {set_fields or 'none'}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {type(self.json_object).__name__}")
        s = self.json_schema
        if hasattr(s, "model_json_schema"):           # a pydantic model class
            self.json_schema = s = s.model_json_schema()
        if isinstance(s, str):
            try:
                self.json_schema = s = json.loads(s)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON text ({e})") from None
        if s is not None and not isinstance(s, dict):
            raise TypeError("json_schema must be a dict, JSON text or a pydantic model class, "
                            f"got {type(s).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty str, got {self.regex!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice:
                raise ValueError("choice must be a non-empty list of str, got "
                                 f"{_short(self.choice)}")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"choice[{i}] must be a non-empty str, got {_short(c)}")
            self.choice = list(self.choice)

    def key(self) -> str:
        """The spec as canonical text (the cache key)."""
        if self.json_schema is not None:
            return "json:" + json.dumps(self.json_schema, sort_keys=True)
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        return "choice:" + json.dumps(self.choice)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _import_llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ImportError("structured output needs llguidance, which is not installed: "
                          f"{INSTALL_HINT}") from None
    return llguidance


class Grammars:
    """Compiles StructuredOutput specs for one tokenizer and vocabulary and fills the masks of a
    step. Thread-safe: the server compiles on worker threads while the engine thread runs.

    tokenizer: a transformers fast tokenizer; vocab_size: the model's logits width (tokens past
    the tokenizer's are never allowed); eos_token_ids: the ids that end a request (the grammar
    allows them once its value is complete)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.lock = threading.Lock()
        self.cache: OrderedDict = OrderedDict()
        self.ll = self.ll_tokenizer = self.limits = self.executor = None

    def _setup(self) -> None:
        """The llguidance tokenizer (~0.8 s for a 49,152-token vocabulary: built once)."""
        if self.ll_tokenizer is not None:
            return
        ll = _import_llguidance()
        tok = self.tokenizer
        if tok is None:
            raise ValueError("structured output needs the Engine's tokenizer: "
                             "Engine(model, config, tokenizer=...)")
        n = len(tok)
        if n > self.vocab_size:
            raise ValueError(f"structured output needs the tokenizer's {n} tokens to fit the "
                             f"model's {self.vocab_size} logits")
        eos = self.eos_token_ids or tok.eos_token_id
        try:
            self.ll_tokenizer = ll.hf.from_tokenizer(tok, n_vocab=self.vocab_size,
                                                     eos_token=eos)
        except ValueError as e:
            raise ValueError(f"structured output cannot use this tokenizer ({e})") from None
        self.limits = ll.LLParserLimits(verbose_errors=False)
        self.executor = ll.LLExecutor()
        self.ll = ll

    def compile(self, spec: StructuredOutput):
        """The matcher of `spec` in its start state (cached); ValueError naming what is wrong
        with the spec, ImportError without llguidance."""
        cached = getattr(spec, "_compiled", (None, None))
        if cached[0] is self:
            return cached[1]
        key = spec.key()
        with self.lock:
            self._setup()
            matcher = self.cache.get(key)
            if matcher is not None:
                self.cache.move_to_end(key)
            else:
                matcher = self._compile(spec)
                self.cache[key] = matcher
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
        spec._compiled = (self, matcher)
        return matcher

    def _compile(self, spec: StructuredOutput):
        M = self.ll.LLMatcher
        if spec.json_schema is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else spec.json_schema
            what = "json_schema"
            try:
                grammar = M.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False})
            except ValueError as e:
                raise ValueError(f"json_schema is not a usable schema: {e}") from None
        elif spec.regex is not None:
            what, grammar = "regex", M.grammar_from_regex(spec.regex)
        else:
            what = "choice"
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                                 for c in spec.choice))
        matcher = M(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            message = matcher.get_error().strip()[:MAX_ERROR_CHARS]
            raise ValueError(f"{what} is not a usable {what.replace('_', ' ')}: {message}")
        return matcher

    def start(self, spec: StructuredOutput):
        """A matcher of `spec` in its start state, for one sequence."""
        return self.compile(spec).deep_copy()

    def mask(self, x: torch.Tensor, rows: list, matchers: list) -> None:
        """x: fp32 [num_rows, vocab_size] logits; rows: the row indices whose sequences have a
        grammar, matchers: theirs. Sets the logits of the tokens a row's grammar does not allow
        next to -inf, in place; other rows are not read."""
        bitmask = np.empty((len(rows), (self.vocab_size + 31) // 32), dtype=np.int32)
        self.ll.numpy.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        # A matcher in an error state allows only EOS; should that be outside the logits, its
        # row is left as it is (an all -inf row would sample NaN) and its grammar ends it.
        bitmask[~bitmask.any(axis=1)] = -1
        # One bit per token, 1 = allowed: unpacked inverted, 1 byte per token is the bool mask
        # of the blocked ones (16 x 49,152: 0.1 ms; torch's shifts and compares took 1.2 ms).
        blocked = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")
        blocked = torch.from_numpy(blocked.view(np.bool_)[:, :x.shape[1]]).to(x.device)
        if len(rows) == x.shape[0]:
            x.masked_fill_(blocked, -float("inf"))
        else:
            index = torch.tensor(rows, device=x.device)
            x[index] = x[index].masked_fill(blocked, -float("inf"))


def consume(matchers: list, tokens: list) -> None:
    """Each matcher takes its row's chosen token (one that its mask allowed)."""
    for m, t in zip(matchers, tokens):
        m.consume_token(t)


def finish_reason(matcher) -> Optional[tuple]:
    """("stop", None) once the grammar takes no more tokens, ("error", message) if it failed;
    None while it goes on."""
    if not matcher.is_stopped():
        return None
    if matcher.is_error():
        return "error", "structured output: " + matcher.get_error().strip()[:MAX_ERROR_CHARS]
    return "stop", None
