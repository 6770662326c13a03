"""The request schemas and their SamplingParams, without a server."""
import os

import pytest

if not os.environ.get("CBK_REQUIRE_SERVE_TESTS"):
    pytest.importorskip("pydantic", reason="needs the serve extra: pip install -e '.[serve]'")

from cb_kernels.serve.protocol import (ChatRequest, CompletionRequest, RequestError,  # noqa: E402
                                       check_unsupported, field_path, param_named_in,
                                       sampling_params)


def test_every_request_field_reaches_sampling_params():
    req = CompletionRequest.model_validate_json(
        '{"model": "m", "prompt": "x", "max_tokens": 9, "temperature": 0.7, "top_p": 0.8, "n": 3,'
        ' "stop": ["a", "b"], "seed": 5, "presence_penalty": 0.5, "frequency_penalty": -0.5,'
        ' "logit_bias": {"7": -3.5}, "logprobs": 2, "top_k": 40, "min_p": 0.05,'
        ' "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": true,'
        ' "include_stop_str_in_output": true, "stop_token_ids": [3, 4]}')
    p = sampling_params(req, 9)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == \
        (9, 0.7, 0.8, 3, ("a", "b"), 5)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.logprobs) == \
        (0.5, -0.5, {7: -3.5}, 2)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_new_tokens, p.ignore_eos) == \
        (40, 0.05, 1.1, 2, True)
    assert p.include_stop_str_in_output and p.stop_token_ids == (3, 4)
    chat = ChatRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true,'
        ' "top_logprobs": 4, "max_completion_tokens": 5, "top_k": -1}')
    p = sampling_params(chat, 5)
    assert p.logprobs == 4 and p.top_k == 0 and p.temperature == 1.0     # OpenAI's default
    chat = ChatRequest.model_validate_json('{"model": "m", "messages": [{"role": "user", '
                                           '"content": "x"}], "logprobs": true}')
    assert sampling_params(chat, 5).logprobs == 0     # the chosen token's logprob alone
    plain = ChatRequest.model_validate_json('{"model": "m", "messages": [{"role": "user"}]}')
    assert sampling_params(plain, 5).logprobs is None


@pytest.mark.parametrize("body, param", [
    ('{"model": "m", "prompt": "x", "echo": true}', "echo"),
    ('{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
    ('{"model": "m", "prompt": "x", "best_of": 3}', "best_of"),
    ('{"model": "m", "prompt": "x", "stop": ["a", ""]}', "stop"),
    ('{"model": "m", "prompt": "x", "stop": ' + str(["s"] * 17).replace("'", '"') + '}', "stop"),
    ('{"model": "m", "messages": [{"role": "user"}], "tool_choice": "auto"}', "tool_choice"),
])
def test_unsupported_fields_are_refused_by_name(body, param):
    schema = ChatRequest if '"messages"' in body else CompletionRequest
    with pytest.raises(RequestError) as e:
        check_unsupported(schema.model_validate_json(body))
    assert e.value.param == param and e.value.status == 400


def test_error_paths_and_names():
    assert field_path(("messages", 0, "content", 2, "type")) == "messages[0].content[2].type"
    assert param_named_in("min_new_tokens (5) must be <= max_new_tokens (3)", "prompt") == \
        "min_tokens"
    assert param_named_in("something else", "prompt") == "prompt"
    req = CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "min_tokens": 4}')
    with pytest.raises(RequestError, match=r"min_tokens \(4\) must be <= max_tokens \(3\)"):
        sampling_params(req, 3)
    req = CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "temperature": 1e-7}')
    with pytest.raises(RequestError) as e:
        sampling_params(req, 3)
    assert e.value.param == "temperature"


@pytest.mark.parametrize("bias, message, http_only", [
    ({"x": 1.0}, "logit_bias keys must be token ids, got 'x'", False),
    ({"-2": 1.0}, "logit_bias key -2 is not a token id", False),
    ({" 5 ": 1.0}, "logit_bias keys must be token ids, got ' 5 '", False),    # int() took these
    ({"1_0": 1.0}, "logit_bias keys must be token ids, got '1_0'", False),
    ({"5": 500.0}, r"logit_bias\[5\] must be in \[-100, 100\], got 500.0", True),   # OpenAI's bound
], ids=["not-an-id", "negative-id", "spaces", "underscore", "out-of-range"])
def test_logit_bias_has_one_parser_for_http_and_the_cli(bias, message, http_only):
    from cb_kernels.engine.config import SamplingParams
    from cb_kernels.generate_cli import params_of

    req = CompletionRequest(model="m", prompt="x", logit_bias=bias)
    with pytest.raises(RequestError, match=message) as e:
        sampling_params(req, 9)
    assert e.value.param == "logit_bias"
    if http_only:       # the generate command takes any finite bias
        assert params_of({"logit_bias": bias}, SamplingParams(), None, 0).logit_bias == {5: 500.0}
    else:
        with pytest.raises(ValueError, match=message):
            params_of({"logit_bias": bias}, SamplingParams(), None, 0)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_plain_stream_chunks_are_the_bytes_of_the_general_path(chat, usage):
    """Reply's per-request chunk template (text deltas without logprobs or token ids) makes
    byte for byte what json.dumps of the whole chunk makes: quotes, newlines, non-ASCII, the
    empty last delta and every finish reason."""
    from types import SimpleNamespace

    from cb_kernels.serve.openai_format import Reply

    body = {"model": 'm "x"', "stream": True, "stream_options": {"include_usage": usage}}
    req = ChatRequest.model_validate({**body, "messages": [{"role": "user", "content": "x"}]}) \
        if chat else CompletionRequest.model_validate({**body, "prompt": "x"})
    ticket = SimpleNamespace(request_id="cmpl-1", params=sampling_params(req, 4), token_ids=[1])
    reply = Reply(req, [ticket], chat, 'm "x"', None, None)
    plain = reply._plain_chunk(usage)
    for text, finish in (('hé "q"\n\\ 🦙', None), ("", "stop"), ("", None), ("a", "length"),
                         ("", "cancelled")):
        want = reply.chunk([reply.choice(7, text, finish, None, delta=True)], None, usage)
        assert plain(7, text, finish) == want
