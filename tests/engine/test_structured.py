"""Structured output (SamplingParams(structured=...), engine/structured.py) on a tiny random Llama
with a byte-level BPE tokenizer built offline: every output parses and validates against its
schema, greedy and sampled, streamed and not; a greedy structured request takes the argmax of
the masked logits (checked against transformers' forward + llguidance's mask, token for token);
a request without a grammar gets exactly its tokens alone, whatever structured rows share its
steps; bad specs are refused at add_request, naming the problem."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams, StructuredOutput
from cb_kernels.engine.structured import Grammars
from tests.helpers import make_byte_tokenizer, make_model, run_checked

# Bounded schemas: a random model finishes each within MAX_NEW tokens (every token is >= 1 byte).
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["kind", "ids", "inner"],
          "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]},
                         "ids": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "integer", "minimum": -9, "maximum": 99}},
                         "inner": {"type": "object", "additionalProperties": False,
                                   "required": ["note", "flag"],
                                   "properties": {"note": {"type": ["string", "null"],
                                                           "maxLength": 4},
                                                  "flag": {"const": True}}}}}
ANY_OF = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}]}
SCHEMAS = {"person": PERSON, "nested": NESTED, "any_of": ANY_OF}
PROMPTS = ["the quick brown fox", '{"name": "Ada"', "0123 lazy dog"]
MAX_NEW = 160


@pytest.fixture(scope="module")
def tokenizer():
    return make_byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=3)


def make_engine(model, tokenizer, **config):
    return Engine(model, EngineConfig(block_size=16, num_blocks=96, **config),
                  tokenizer=tokenizer)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return make_engine(model, tokenizer)


def check_valid(outputs, schema):
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason, out.error)
            jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_outputs_parse_and_validate(engine, name, temperature):
    schema = SCHEMAS[name]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=11,
                            structured=StructuredOutput(json_schema=schema))
    outputs = engine.generate(PROMPTS, params)
    check_valid(outputs, schema)
    engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_streamed_text_equals_the_answer_and_validates(engine, temperature):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=5,
                            structured=StructuredOutput(json_schema=NESTED))
    texts, finals = {}, {}
    for delta in engine.stream(PROMPTS, params):
        texts[delta.request_id] = texts.get(delta.request_id, "") + (delta.text or "")
        if delta.finish_reason is not None:
            finals[delta.request_id] = delta.finish_reason
    assert set(finals.values()) == {"stop"}
    answers = engine.generate(PROMPTS, params)
    assert sorted(texts.values()) == sorted(o.text for o in answers)
    for text in texts.values():
        jsonschema.validate(json.loads(text), NESTED)


def test_json_object_regex_choice_and_n_samples(engine, tokenizer):
    # A +4 bias on '"' and '}' makes the random model close its strings and objects soon.
    bias = {tokenizer.convert_tokens_to_ids(c): 4.0 for c in '"}'}
    for t in (0.0, 1.0):
        outs = engine.generate(PROMPTS, SamplingParams(
            max_new_tokens=MAX_NEW, temperature=t, seed=2, logit_bias=bias,
            structured=StructuredOutput(json_object=True)))
        for o in outs:
            assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text
    outs = engine.generate(PROMPTS, SamplingParams(
        max_new_tokens=40, temperature=1.0, seed=4,
        structured=StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}")))
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text), o.text
    choices = ["yes", "no", "not sure", '"quoted"\n']
    out = engine.generate(["the fox"], SamplingParams(
        max_new_tokens=20, temperature=1.0, seed=9, n=6,
        structured=StructuredOutput(choice=choices)))[0]
    assert len(out.outputs) == 6
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.text in choices, c.text
    assert len({c.text for c in out.outputs}) > 1      # the samples draw independently


@torch.inference_mode()
def masked_greedy_reference(model, tokenizer, prompt_ids, schema, max_new):
    """Greedy tokens of transformers' forward with llguidance's own mask applied each step."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    vocab = model.config.vocab_size
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}), log_level=0)
    ids, out = list(prompt_ids), []
    mask = np.empty((1, (vocab + 31) // 32), dtype=np.int32)
    while len(out) < max_new and not m.is_stopped():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        llguidance.numpy.fill_next_token_bitmask(m, mask)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        logits[~torch.from_numpy(allowed)] = -float("inf")
        token = int(logits.argmax())
        assert m.consume_token(token)
        ids.append(token)
        out.append(token)
    return out


def test_greedy_takes_the_argmax_of_the_masked_logits(engine, model, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(
        max_new_tokens=MAX_NEW, structured=StructuredOutput(json_schema=PERSON)))
    for p, o in list(zip(prompts, outs))[:2]:        # 2 of the batch's 3: the reference is slow
        assert o.token_ids == masked_greedy_reference(model, tokenizer, p, PERSON, MAX_NEW)


def test_rows_without_a_grammar_get_their_tokens_alone(model, tokenizer):
    plain = [SamplingParams(max_new_tokens=24),
             SamplingParams(max_new_tokens=24, temperature=0.9, top_k=50, seed=21),
             SamplingParams(max_new_tokens=24, temperature=1.0, seed=8, logprobs=2)]
    prompts = ["the lazy dog", "quick 42", "fox jumps over"]
    alone = [make_engine(model, tokenizer).generate([p], s)[0]
             for p, s in zip(prompts, plain)]
    guided = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=3,
                            structured=StructuredOutput(json_schema=NESTED))
    greedy_guided = SamplingParams(max_new_tokens=MAX_NEW,
                                   structured=StructuredOutput(json_schema=PERSON))
    engine = make_engine(model, tokenizer)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, plain)]
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, guided if i % 2 else greedy_guided)
    outputs = run_checked(engine)
    for rid, ref in zip(ids, alone):
        assert outputs[rid].token_ids == ref.token_ids
        assert outputs[rid].outputs[0].logprobs == ref.outputs[0].logprobs
    assert engine.stats()["used_blocks"] == 0


def test_grammars_are_cached_per_spec(engine):
    a = StructuredOutput(json_schema=dict(PERSON))
    b = StructuredOutput(json_schema=json.dumps(PERSON))
    assert engine.grammars.compile(a) is engine.grammars.compile(b)
    assert engine.grammars.compile(StructuredOutput(json_object=True)) is not \
        engine.grammars.compile(a)


def test_bad_specs_are_refused_naming_the_problem(engine, model):
    for kwargs, error, words in [
            ({}, ValueError, "exactly one"),
            ({"json_object": True, "regex": "a"}, ValueError, "exactly one"),
            ({"json_schema": "{not json"}, ValueError, "not valid JSON"),
            ({"json_schema": 3}, TypeError, "json_schema must be"),
            ({"choice": "yes"}, ValueError, "choice must be"),
            ({"choice": ["a", ""]}, ValueError, "choice[1]"),
            ({"regex": ""}, ValueError, "regex must be")]:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            StructuredOutput(**kwargs)
    for spec, words in [
            (StructuredOutput(json_schema={"type": "objec"}), "Invalid type: objec"),
            (StructuredOutput(json_schema={"type": "string", "minLength": 5, "maxLength": 2}),
             "minLength"),
            (StructuredOutput(json_schema={"$ref": "#/nope"}), "nope"),
            (StructuredOutput(regex="(("), "unclosed group")]:
        with pytest.raises(ValueError, match=words):
            engine.add_request("x", SamplingParams(structured=spec))
    assert not engine.has_unfinished()
    with pytest.raises(TypeError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"json_object": True})
    with pytest.raises(ValueError, match="min_new_tokens cannot be combined"):
        SamplingParams(min_new_tokens=2, structured=StructuredOutput(json_object=True))
    no_tokenizer = Engine(model, EngineConfig(block_size=16, num_blocks=8))
    with pytest.raises(ValueError, match="needs the Engine's tokenizer"):
        no_tokenizer.add_request([1, 2], SamplingParams(
            structured=StructuredOutput(json_object=True)))


def test_missing_extra_names_it(monkeypatch, tokenizer):
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)     # import fails
    with pytest.raises(ImportError, match=r"cb_kernels\[structured\]"):
        Grammars(tokenizer, 500).compile(StructuredOutput(json_object=True))
