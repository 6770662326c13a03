"""Streamed text of a byte-level tokenizer: a character split over several tokens (emoji, CJK)
is sent once it is whole, never as U+FFFD followed by the text again."""

from cb_kernels import SamplingParams
from cb_kernels.engine.frontend import Frontend
from cb_kernels.engine.sequence import Sequence


def test_stream_deltas_hold_back_a_partial_character(smollm2):
    _, tok = smollm2
    text = "Hi 🦙 there 日本語!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))  # splits
    frontend = Frontend(tok)
    seq = Sequence(0, "r", [1], SamplingParams(max_new_tokens=len(ids)))
    pieces = []
    for k, t in enumerate(ids):
        seq.token_ids.append(t)
        final = k == len(ids) - 1
        if final:
            seq.finish_reason = "length"
        pieces += [d.text for d in frontend.deltas(seq, final)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
