"""A request's prompts as token ids: completions' prompt (text, texts, ids or lists of ids)
through the tokenizer, chat messages through its chat template. RequestError names the field
of anything it cannot take."""
from __future__ import annotations

import copy

from cb_kernels.serve.protocol import ChatRequest, CompletionRequest, RequestError

# apply_chat_template's own parameters: a client passing one of these through chat_template_kwargs
# would choose the template itself (a 245-byte nested loop froze the server for 12 s; vLLM's
# CVE-2025-61620 is the same hole) or the tokenizer's padding (`max_length` 3e7 cost 3.3 GB).
# chat_template_kwargs carries template variables only.
TEMPLATE_OPTIONS = frozenset({
    "chat_template", "tokenize", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "pad_to_multiple_of", "padding_side", "add_special_tokens", "kwargs"})


def check_template_kwargs(kwargs) -> None:
    """RequestError naming the first key of chat_template_kwargs that is not a template
    variable (an apply_chat_template or tokenizer option)."""
    for key in kwargs or {}:
        if key in TEMPLATE_OPTIONS or key.startswith("return_"):
            raise RequestError(f"chat_template_kwargs.{key} is not allowed: chat_template_kwargs "
                               "carries template variables only, not chat template or tokenizer "
                               "options", f"chat_template_kwargs.{key}")


class Prompts:
    """Not thread-safe: the server calls it from its one tokenizer thread."""

    def __init__(self, tokenizer, max_positions: int):
        # The engine thread decodes with engine.tokenizer; the tokenizer thread encodes with its
        # own copy (a fast tokenizer is not safe to use from two threads at once).
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        # No token of the vocabulary spells more than `longest` characters, so a text longer than
        # max_positions x longest characters is more tokens than the model takes: refused before
        # tokenizing (a 20 MB prompt took 26 s and +4.6 GB to reach its 400). A tokenizer mapping
        # unknown words to one <unk> token breaks this bound; byte-level BPE and SentencePiece
        # with byte fallback keep it.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) \
            if tokenizer is not None else 1
        self.max_chars = max_positions * max(longest, 1)

    def check_length(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise RequestError(f"{param} holds {chars} characters, more than the model's context "
                               f"can hold as tokens (at most {self.max_chars} characters: "
                               "max positions x the longest token)", param)

    def of(self, req) -> list:
        """The token ids of each prompt of `req` (one for chat)."""
        return self.chat(req) if isinstance(req, ChatRequest) else self.completion(req)

    def encode(self, text: str, param: str) -> list:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send prompt token ids instead of "
                               "text", param)
        self.check_length(len(text), param)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def completion(self, req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str):
            return [self.encode(p, "prompt")]
        if not p:
            raise RequestError("prompt is an empty list", "prompt")
        if isinstance(p[0], str):
            return [self.encode(s, f"prompt[{i}]") for i, s in enumerate(p)]
        if isinstance(p[0], int):
            return [list(p)]
        for i, ids in enumerate(p):
            if not ids:
                raise RequestError(f"prompt[{i}] is an empty list of token ids", f"prompt[{i}]")
        return [list(ids) for ids in p]

    def chat(self, req: ChatRequest) -> list:
        check_template_kwargs(req.chat_template_kwargs)
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template; use /v1/completions",
                               "messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise RequestError(f"messages[{i}].content[{j}]: only text parts are "
                                           f"supported, got type {part.type!r}",
                                           f"messages[{i}].content[{j}].type")
                content = "".join(part.text for part in content)
            msg = {**(m.model_extra or {}), "role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        self.check_length(sum(len(m["content"] or "") for m in messages), "messages")
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                          tokenize=True, return_dict=False,
                                          **(req.chat_template_kwargs or {}))
        except Exception as e:       # jinja2's TemplateError, UndefinedError, ... of the template
            raise RequestError(f"the chat template cannot render messages ({type(e).__name__}: "
                               f"{e})", "messages") from None
        return [list(ids)]
