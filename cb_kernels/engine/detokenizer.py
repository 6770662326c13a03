"""IncrementalDetokenizer: a request's output text as its tokens arrive, and stop strings on it.

Decoding every output token again at each step costs O(length) per token; instead the text grows
by the difference between decoding a short window of the newest tokens with and without the
last ones (the window starts one token back, so tokenizers that drop a word's leading space at
the start of a decode still render it). A window whose decode ends in U+FFFD is waiting for the
rest of a multi-byte character and adds nothing yet. Stop strings are searched only in the text
that could hold a new match (the new characters and the len(stop) - 1 before them), so a match
across token boundaries counts. Streaming holds back only the characters that could still
start a match (`stream_text`).
"""
from __future__ import annotations

from typing import Optional


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple, include_stop: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.text = ""
        self.prefix_offset = 0      # first token of the decode window
        self.read_offset = 0        # tokens up to here are in `text`
        self.finished = False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, output_ids: list, check: bool = True) -> Optional[str]:
        """Take the output tokens past read_offset into the text; with `check`, returns the stop
        string that now occurs (the text is then cut before it, or after it with
        include_stop_str_in_output), else None."""
        before = self._decode(output_ids[self.prefix_offset:self.read_offset])
        window = self._decode(output_ids[self.prefix_offset:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return None
        new = window[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        start = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
        self.text += new
        if not check:
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
