"""`cb-kernels serve` with response_format (structured output), as a real process driven by the
openai client: json_schema (also through the client's pydantic `parse`) and json_object answers
parse and validate, streamed and not, greedy and sampled, on both endpoints; a bad schema, a
missing one or an unknown type is a 400 naming the field, and the server keeps serving."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
import torch

from tests.helpers import VOCAB, make_byte_tokenizer
from tests.serve.test_serve_http import NAME, Server, openai  # noqa: F401 (skips without the extra)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A random 2-layer Llama with a byte-level BPE tokenizer (every text encodes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=0, bos_token_id=None,
                         pad_token_id=0)
    path = tmp_path_factory.mktemp("structured_model")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok = make_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(path)
    s = Server(path, tmp_path_factory.mktemp("structured_log") / "server.log",
               "--max-num-seqs", "16", "--max-batch-tokens", "256")
    yield s
    s.stop()


def schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_answers_validate(server, temperature, stream):
    kwargs = dict(model=NAME, messages=MESSAGES, max_tokens=120, temperature=temperature,
                  seed=7, n=2, response_format=schema_format(PERSON))
    if stream:
        texts, finish = ["", ""], [None, None]
        for chunk in server.client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
    else:
        r = server.client.chat.completions.create(**kwargs)
        texts = [c.message.content for c in r.choices]
        finish = [c.finish_reason for c in r.choices]
    assert finish == ["stop", "stop"], texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    server.wait_idle()


def test_openai_parse_with_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int = Field(ge=0, le=8)
        indoor: bool

    r = server.client.chat.completions.parse(model=NAME, messages=MESSAGES, max_tokens=60,
                                             temperature=1.0, seed=3, response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json(r.choices[0].message.content) == pet


def test_json_object_on_both_endpoints(server):
    tok = make_byte_tokenizer()
    # A bias on '"' and '}' makes the random model close its strings and objects soon.
    bias = {str(tok.convert_tokens_to_ids(c)): 4 for c in '"}'}
    r = server.client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=1,
        logit_bias=bias, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    status, body, _ = server.post("/v1/completions", {
        "model": NAME, "prompt": "JSON:", "max_tokens": 120, "temperature": 0,
        "logit_bias": bias, "response_format": {"type": "json_object"}})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(body["choices"][0]["text"]), dict)
    status, body, _ = server.post("/v1/completions", {
        "model": NAME, "prompt": "JSON:", "max_tokens": 60, "temperature": 0,
        "response_format": schema_format(PERSON)})
    assert status == 200, body
    jsonschema.validate(json.loads(body["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize("response_format, param, words", [
    (schema_format({"type": "objec"}), "response_format.json_schema.schema",
     "Invalid type: objec"),
    (schema_format({"type": "string", "pattern": "(("}), "response_format.json_schema.schema",
     "unclosed group"),
    (schema_format({"$ref": "#/definitions/nope"}), "response_format.json_schema.schema",
     "nope"),
    ({"type": "json_schema"}, "response_format.json_schema", "is required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema",
     "is required"),
    ({"type": "xml"}, "response_format.type", "json_object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
     "required"),
], ids=["bad-type", "bad-pattern", "bad-ref", "no-json-schema", "no-schema", "unknown-type",
        "no-name"])
def test_bad_response_format_is_a_400_naming_it(server, response_format, param, words):
    status, body, _ = server.post("/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "response_format": response_format})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body
    status, body, _ = server.post("/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "max_tokens": 2, "min_tokens": 1,
        "response_format": {"type": "json_object"}})
    assert status == 400 and body["error"]["param"] == "min_tokens", body
    assert server.health()["status"] == "ok"


def test_vllm_names_structured_outputs_and_guided(server):
    """vLLM's extra_body names: `structured_outputs` {json, regex, choice, json_object} and the
    older `guided_json|regex|choice`; the openai client sends them through extra_body."""
    r = server.client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    for body, check in [
            ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
             lambda t: t in ("yes", "no", "maybe")),
            ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
            ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
             lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and t[4:].isalpha()),
            ({"guided_regex": "(ab|cd){2}"}, lambda t: t in ("abab", "abcd", "cdab", "cdcd")),
            ({"guided_json": json.dumps(PERSON)},
             lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]:
        status, answer, _ = server.post("/v1/completions", {
            "model": NAME, "prompt": "A:", "max_tokens": 60, "temperature": 1.0, "seed": 3,
            "n": 3, **body})
        assert status == 200, (body, answer)
        for c in answer["choices"]:
            assert c["finish_reason"] == "stop" and check(c["text"]), (body, c)


@pytest.mark.parametrize("extra, param, words", [
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar",
     "not supported"),
    ({"structured_outputs": {"json": {"type": "objec"}}}, "structured_outputs.json",
     "Invalid type: objec"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", ""),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "one structured output at a time"),
], ids=["grammar", "bad-schema", "bad-regex", "empty-choice", "unknown-key", "two"])
def test_bad_vllm_structured_is_a_400_naming_it(server, extra, param, words):
    status, body, _ = server.post("/v1/chat/completions", {
        "model": NAME, "messages": MESSAGES, "max_tokens": 8, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body
    assert server.health()["status"] == "ok"
