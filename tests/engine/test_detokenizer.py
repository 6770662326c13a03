"""IncrementalDetokenizer against a full decode: both ways (the Rust DecodeStream and the window
decode) give, piece by piece, exactly `decode(ids, skip_special_tokens=True)` for a byte-level
BPE (SmolLM2's: emoji and CJK split over tokens), a SentencePiece-style Metaspace tokenizer (a
word's leading space dropped at the start of a decode) and a WordPiece-joined word tokenizer,
with special tokens among the output and tokens arriving one or several at a time; stop strings
cut the same text at the first match, across token boundaries."""
import pytest

from cb_kernels import SamplingParams
from cb_kernels.engine.detokenizer import IncrementalDetokenizer, rust_backend
from cb_kernels.engine.frontend import Frontend
from cb_kernels.engine.sequence import Sequence
from tests.helpers import make_tokenizer

TEXTS = [
    "Hello there, world! How are you today?",
    "Hi 🦙 there 日本語! naïve café — déjà vu 🙂🙂",
    "  two leading spaces, a\ttab and a\nnewline  ",
    "x",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's byte-level BPE tokenizer alone (the built-in model's folder; fetched on the
    first run on a machine)."""
    from transformers import AutoTokenizer

    from cb_kernels.models import default_cache_dir, ensure_builtin

    return AutoTokenizer.from_pretrained(ensure_builtin("smollm2-135m", default_cache_dir()))


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style BPE (Metaspace: "▁" marks a word's space, dropped at the start of a
    decode), trained here offline on TEXTS, with two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=False)


def _ids(tok, text: str) -> list:
    """`text`'s ids with special tokens put at the start, inside and at the end."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    special = sorted(tok.all_special_ids)
    s = special[-1]
    return [s] + ids[:len(ids) // 2] + [special[0]] + ids[len(ids) // 2:] + [s]


def _pieces(det: IncrementalDetokenizer, ids: list, chunk: int) -> list:
    pieces = []
    for end in list(range(chunk, len(ids), chunk)) + [len(ids)]:
        before = len(det.text)
        det.append(ids[:end], check=False)
        pieces.append(det.text[before:])
    return pieces


def _tokenizers(request) -> dict:
    return {"smollm2": request.getfixturevalue("smollm2_tokenizer"),
            "metaspace": request.getfixturevalue("metaspace_tokenizer"),
            "words": make_tokenizer()}


@pytest.mark.parametrize("name", ["smollm2", "metaspace", "words"])
@pytest.mark.parametrize("use_rust", [None, False], ids=["rust", "window"])
@pytest.mark.parametrize("chunk", [1, 3], ids=["1-token", "3-token"])
def test_text_equals_a_full_decode(request, name, use_rust, chunk):
    tok = _tokenizers(request)[name]
    texts = TEXTS if name != "words" else ["w1 w2 w3 w499 w7", "w5"]
    for text in texts:
        ids = _ids(tok, text)
        det = IncrementalDetokenizer(tok, use_rust=use_rust)
        assert det.uses_rust is (use_rust is None)     # the Rust way really runs here
        pieces = _pieces(det, ids, chunk)
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == det.text == full, (name, text)
        assert not any("\ufffd" in p for p in pieces)
        if name == "smollm2" and "🦙" in text and chunk == 1:     # a character over 2+ tokens
            assert "" in pieces[1:-1]


def test_rust_backend_only_where_it_decodes_the_same(smollm2_tokenizer):
    assert rust_backend(smollm2_tokenizer) is smollm2_tokenizer.backend_tokenizer

    class OwnDecode(type(smollm2_tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    own = OwnDecode.__new__(OwnDecode)
    own.__dict__.update(smollm2_tokenizer.__dict__)
    assert rust_backend(own) is None
    det = IncrementalDetokenizer(own)
    det.append(smollm2_tokenizer("ab cd", add_special_tokens=False)["input_ids"])
    assert det.text == "AB CD" and not det.uses_rust
    with pytest.raises(ValueError, match="use_rust=True"):
        IncrementalDetokenizer(own, use_rust=True)

    class Slow:      # no Rust backend at all (a slow tokenizer)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)
    assert rust_backend(Slow()) is None


@pytest.mark.parametrize("use_rust", [None, False], ids=["rust", "window"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_strings_cut_at_the_first_match(smollm2_tokenizer, use_rust, include):
    tok = smollm2_tokenizer
    text = "Hi 🦙 there 日本語! and more 日本語 after"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for stop in ("日本", "🦙 th", "e 日", "after"):
        det = IncrementalDetokenizer(tok, (stop, "never there"), include, use_rust=use_rust)
        matched = None
        shown = []
        for k in range(1, len(ids) + 1):
            matched = det.append(ids[:k])
            shown.append(det.stream_text())
            if matched:
                break
        full = tok.decode(ids, skip_special_tokens=True)
        at = full.index(stop)
        assert matched == stop and det.finished
        assert det.text == full[:at + len(stop)] if include else full[:at]
        # what a stream showed before the match never held a piece of the stop string
        for s in shown[:-1]:
            assert stop not in s and full.startswith(s) and len(s) <= at


def test_stream_text_holds_back_a_possible_match():
    tok = make_tokenizer()
    det = IncrementalDetokenizer(tok, ("w3 w4 w9",), False)
    for k, ids in enumerate(([1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5])):
        assert det.append(ids) is None
    # "w1 w2 w3 w4" ended in "w3 w4", a start of the stop string, until w5 came
    assert det.text == "w1 w2 w3 w4 w5" and det.stream_text() == det.text
    det2 = IncrementalDetokenizer(tok, ("w3 w4 w9",), False)
    det2.append([1, 2, 3, 4])
    assert det2.stream_text() == "w1 w2 "


@pytest.mark.parametrize("name", ["smollm2", "metaspace"])
def test_stream_deltas_add_up_to_the_final_text(request, name):
    """Frontend deltas of a request without stop strings (the incremental way mid-stream, a full
    decode for the last) add up to the full decode, read every step or every few steps."""
    tok = _tokenizers(request)[name]
    for every in (1, 4):
        for text in TEXTS:
            ids = _ids(tok, text)
            frontend = Frontend(tok)
            seq = Sequence(0, "r", [1], SamplingParams(max_new_tokens=len(ids)))
            pieces = []
            for k, t in enumerate(ids):
                seq.token_ids.append(t)
                final = k == len(ids) - 1
                if final or k % every == 0:
                    pieces += [d.text for d in frontend.deltas(seq, final)]
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
            assert seq.detokenizer is not None and seq.detokenizer.uses_rust
