"""The OpenAI request bodies the server takes (pydantic), their SamplingParams (`sampling_params`,
the one place a request becomes one), the error body, and the rewriting of pydantic's and the
engine's refusals as errors that name the request's field.

Requests are parsed strictly (a string where a number belongs is refused, not converted) and
unknown fields are refused, so a typo ("max_token") is reported instead of silently ignored. A few
fields that OpenAI clients send but this server does not act on are accepted and ignored (`user`,
`store`, `metadata`, `service_tier`, `parallel_tool_calls`); fields it cannot honour (`tools`,
`echo`, `suffix`, `best_of` > n) are refused by name. `response_format` (json_object, json_schema;
both endpoints), and vLLM's `structured_outputs` {json, regex, choice, json_object} and older
`guided_json|regex|choice`, become SamplingParams.structured (`structured_output`).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cb_kernels.engine.config import SEED_LIMIT, SamplingParams, parse_logit_bias
from cb_kernels.engine.structured import StructuredOutput

MAX_N = 128           # samples per prompt
MAX_LOGPROBS = 20     # top logprobs per token (OpenAI's chat limit)
MAX_STOP = 16         # stop strings per request


class RequestError(Exception):
    """A request the server refuses: the HTTP status, OpenAI's error type, the field at fault."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def field_path(loc) -> str:
    """A pydantic error location as a field path: ("messages", 0, "role") -> messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None      # the schema is always followed strictly


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its extra_body field): exactly one of these."""

    json: Optional[Union[dict[str, Any], str]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    json_object: Optional[bool] = None
    grammar: Optional[str] = None          # refused by name: no EBNF grammars here


class _Request(_Strict):
    """The fields both endpoints share (OpenAI's, then the extensions vLLM also takes)."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    # extensions
    top_k: int = Field(0, ge=-1)             # 0 or -1: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stop_token_ids: Optional[list[int]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None       # vLLM's name
    guided_json: Optional[Union[dict[str, Any], str]] = None     # vLLM's older names
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    # for RL clients (TRL's VLLMClient), as vLLM: the prompt's and each choice's token ids in the
    # answer; logprob tokens spelled "token_id:N" (a token's text may not map back to one id)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # accepted, not acted on
    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # Other keys (tool_calls, refusal, ...) are let through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list] = None
    parallel_tool_calls: Optional[bool] = None


def _no_duplicates(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise RequestError(f"the request body holds the key {key!r} twice (which one is "
                               "meant is ambiguous)", key, code="duplicate_key")
        seen.add(key)
    return dict(pairs)


def check_duplicate_keys(raw: bytes) -> None:
    """RequestError naming a key that appears twice in one JSON object of `raw` (a JSON parser
    keeps the last one silently; a proxy or filter in front may have checked the first). Invalid
    JSON is left to the schema's parser, whose message says where it breaks."""
    try:
        json.loads(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        pass


def check_unsupported(req: _Request) -> None:
    """RequestError for a field this server cannot honour (set to anything but its default)."""
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise RequestError("echo is not supported by this server", "echo")
        if req.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError(f"best_of ({req.best_of}) other than n is not supported", "best_of")
    else:
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise RequestError(f"{name} (tool calling) is not supported by this server", name)
        if req.tool_choice not in (None, "none"):
            raise RequestError("tool_choice is not supported by this server", "tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise RequestError(f"stop holds {len(req.stop)} strings, at most {MAX_STOP} are allowed",
                           "stop")
    for i, s in enumerate([req.stop] if isinstance(req.stop, str) else req.stop or []):
        if not s:
            raise RequestError(f"stop[{i}] is an empty string", "stop")


def logprobs_k(req: _Request) -> Optional[int]:
    """SamplingParams.logprobs of the request: completions' `logprobs: k`, chat's
    `logprobs: true` with `top_logprobs: k` (0 when absent: the chosen token's only)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def requested_max_tokens(req: _Request) -> Optional[int]:
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


# SamplingParams field -> the request field a message about it names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                "logprobs": "logprobs", "stop_token_ids": "stop_token_ids", "stop": "stop",
                "logit_bias": "logit_bias", "seed": "seed", "temperature": "temperature",
                "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty"}


def param_named_in(message: str, default: Optional[str]) -> Optional[str]:
    """The request field an engine error message is about (the first SamplingParams field it
    names, translated), else `default`."""
    best = None
    for name, param in _PARAM_NAMES.items():
        at = message.find(name)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, param)
    return best[1] if best else default


def _vllm_structured(req: _Request) -> dict:
    """{field path: StructuredOutput keyword} of vLLM's names set on `req`."""
    asked = {}
    so = req.structured_outputs
    if so is not None:
        if so.grammar is not None:
            raise RequestError("structured_outputs.grammar (EBNF) is not supported by this "
                               "server; use json, regex, choice or json_object",
                               "structured_outputs.grammar")
        for field, key in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                           ("json_object", "json_object")):
            value = getattr(so, field)
            if value is not None and value is not False:
                asked[f"structured_outputs.{field}"] = (key, value)
    for field, key in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                       ("guided_choice", "choice")):
        if getattr(req, field) is not None:
            asked[field] = (key, getattr(req, field))
    return asked


def structured_field(req: _Request) -> str:
    """The request field a structured output came from (what a compile error names)."""
    vllm = _vllm_structured(req)
    if vllm:
        return next(iter(vllm))
    rf = req.response_format
    return "response_format" + (".json_schema.schema" if rf and rf.type == "json_schema" else "")


def structured_output(req: _Request) -> Optional[StructuredOutput]:
    """The StructuredOutput of `req.response_format`, or of vLLM's `structured_outputs` /
    `guided_json|regex|choice` (None for none or text); RequestError naming the field. The
    grammar is compiled later, off the event loop (routes.py)."""
    rf = req.response_format
    vllm = _vllm_structured(req)
    formats = ([] if rf is None or rf.type == "text" else ["response_format"]) + list(vllm)
    if not formats:
        return None
    if len(formats) > 1:
        raise RequestError(f"one structured output at a time: got {', '.join(formats)}",
                           formats[1])
    if req.min_tokens:
        raise RequestError("min_tokens cannot be combined with a structured output (the format "
                           "decides where the output ends)", "min_tokens")
    if vllm:
        (where, (key, value)), = vllm.items()
        if key == "choice" and not value:
            raise RequestError(f"{where} is an empty list", where)
        return StructuredOutput(**{key: value})
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        where = "response_format.json_schema" + (".schema" if rf.json_schema else "")
        raise RequestError(f"{where} is required when response_format.type is 'json_schema'",
                           where)
    return StructuredOutput(json_schema=rf.json_schema.schema_)


def sampling_params(req: _Request, max_new_tokens: int,
                    structured: Optional[StructuredOutput] = None) -> SamplingParams:
    """The SamplingParams of `req`; RequestError naming the field for a value the engine refuses."""
    try:
        bias = parse_logit_bias(req.logit_bias or None, max_abs=100)
    except ValueError as e:
        raise RequestError(str(e), "logit_bias") from None
    if req.min_tokens > max_new_tokens:
        raise RequestError(f"min_tokens ({req.min_tokens}) must be <= max_tokens "
                           f"({max_new_tokens})", "min_tokens")
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=max(req.top_k, 0), min_p=req.min_p, seed=req.seed, n=req.n,
            logprobs=logprobs_k(req), stop=req.stop,
            include_stop_str_in_output=req.include_stop_str_in_output,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            min_new_tokens=req.min_tokens, repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
            logit_bias=bias, structured=structured)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), param_named_in(str(e), None)) from None


# Names pydantic puts in an error location for the member of a union that failed.
_UNION_TYPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids", "stop": "a string or a list of strings"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def validation_error(e: ValidationError) -> RequestError:
    """The RequestError of a body pydantic refused: the first error, its field named."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})")
    loc = [p for p in first["loc"] if isinstance(p, int) or
           (p not in _UNION_TAGS and "[" not in str(p) and not str(p).startswith("function-"))]
    param = field_path(loc) or None
    if param is None:
        return RequestError(f"the request body must be a JSON object ({first['msg']})")
    same = [err for err in errors if err["loc"][:1] == first["loc"][:1]]
    if first["type"] == "missing":
        return RequestError(f"{param} is required", param)
    if first["type"] == "extra_forbidden":
        return RequestError(f"{param} is not a field this server knows (check the spelling)",
                            param)
    if len(same) > 1 and len(loc) == 1:      # no member of a union took it
        what = _UNION_TYPES.get(param, "of another type")
        return RequestError(f"{param} must be {what}, got {_short(first['input'])}", param)
    return RequestError(f"{param}: {first['msg']}, got {_short(first['input'])}", param)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def prompt_error(message: str, where: str, asked_max_tokens: bool) -> tuple:
    """(message, param) of an Engine.check_request error about the prompt at `where`."""
    about_length = "max_new_tokens" in message
    message = message.replace("max_new_tokens", "max_tokens")
    if message.startswith("prompt"):
        message = where + message[len("prompt"):]
    if about_length:          # the prompt fits alone: max_tokens is what to change, if it was asked
        return message, "max_tokens" if asked_max_tokens else where
    if message.startswith(where):
        return message, where
    return message, param_named_in(message, where)
