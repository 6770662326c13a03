"""IncrementalDetokenizer: a request's output text as its tokens arrive, and stop strings on it.

Decoding every output token again at each step costs O(length) per token (14 us a token on
average over a 64-token answer with SmolLM2's tokenizer, 2-core Zen 4, growing with the length);
instead the text grows by what the newest tokens add. Two ways, the same rule:
  - a Hugging Face fast tokenizer (a `tokenizers.Tokenizer` backend, no
    clean_up_tokenization_spaces, no decode of its own) steps a `tokenizers.decoders.DecodeStream`
    in Rust: 0.8 us a token on the same machine;
  - any other tokenizer decodes a short window of the newest tokens with and without the last
    ones (the window starts one token back, so tokenizers that drop a word's leading space at
    the start of a decode still render it): two short `decode` calls a token.
Either way a piece whose decode ends in U+FFFD is waiting for the rest of a multi-byte character
and adds nothing yet, and special tokens are skipped as `decode(skip_special_tokens=True)` skips
them. tests/engine/test_detokenizer.py holds both ways equal to a full decode.

Stop strings are searched only in the text that could hold a new match (the new characters and
the len(stop) - 1 before them), so a match across token boundaries counts. Streaming holds back
only the characters that could still start a match (`stream_text`).
"""
from __future__ import annotations

from typing import Optional


def rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` that decodes for `tokenizer` exactly as its `decode` does, or
    None (no DecodeStream in this tokenizers version, a slow tokenizer, space clean-up on, or a
    class that decodes its own way)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     True):
        return None
    # decode/_decode must come from the class that owns the backend (or above it): a subclass
    # that overrides them (custom spacing, byte fallback in Python) decodes differently.
    mro = type(tokenizer).__mro__
    owner = next((i for i, c in enumerate(mro) if "backend_tokenizer" in vars(c)), None)
    for name in ("decode", "_decode"):
        where = next((i for i, c in enumerate(mro) if name in vars(c)), None)
        if owner is None or where is None or where < owner:
            return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple = (), include_stop: bool = False,
                 use_rust: Optional[bool] = None):
        """`stop`: stop strings (may be empty: text only). `use_rust`: None picks the Rust
        DecodeStream where `rust_backend` allows it; False forces the window decode (tests)."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop or ())
        self.include_stop = include_stop
        self.text = ""
        self.prefix_offset = 0      # first token of the decode window (window way)
        self.read_offset = 0        # output tokens taken so far
        self.finished = False
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._backend = rust_backend(tokenizer) if use_rust is not False else None
        if use_rust and self._backend is None:
            raise ValueError("use_rust=True but this tokenizer cannot be decoded by a "
                             "tokenizers DecodeStream (see rust_backend)")
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(skip_special_tokens=True)

    @property
    def uses_rust(self) -> bool:
        return self._stream is not None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, output_ids: list) -> str:
        """The text the tokens past read_offset add ("" while a character is incomplete)."""
        if self._stream is not None:
            new_ids = output_ids[self.read_offset:]
            self.read_offset = len(output_ids)
            new = self._stream.step(self._backend, new_ids) if len(new_ids) > 1 else \
                self._stream.step(self._backend, new_ids[0]) if new_ids else None
            return new or ""
        before = self._decode(output_ids[self.prefix_offset:self.read_offset])
        window = self._decode(output_ids[self.prefix_offset:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        return window[len(before):]

    def append(self, output_ids: list, check: bool = True) -> Optional[str]:
        """Take the output tokens past read_offset into the text; with `check`, returns the stop
        string that now occurs (the text is then cut before it, or after it with
        include_stop_str_in_output), else None."""
        new = self._new_text(output_ids)
        if not new:
            return None
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += new
        if not check or not self.stop:
            return None
        best = None
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[:at + len(s) if self.include_stop else at]
        self.finished = True
        return s

    def stream_text(self) -> str:
        """The text a stream may show now: all of it once finished, else without the longest
        tail that is a proper prefix of some stop string."""
        if self.finished:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold]
