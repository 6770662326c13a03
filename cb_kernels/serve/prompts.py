"""A request's prompts as token ids: completions' prompt (text, texts, ids or lists of ids)
through the tokenizer, chat messages through its chat template. RequestError names the field
of anything it cannot take."""
from __future__ import annotations

import copy

from cb_kernels.serve.protocol import ChatRequest, CompletionRequest, RequestError


class Prompts:
    def __init__(self, tokenizer):
        # The engine thread decodes with engine.tokenizer; the event loop encodes with its own copy
        # (a fast tokenizer is not safe to use from two threads at once).
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None

    def of(self, req) -> list:
        """The token ids of each prompt of `req` (one for chat)."""
        return self.chat(req) if isinstance(req, ChatRequest) else self.completion(req)

    def encode(self, text: str, param: str) -> list:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: send prompt token ids instead of "
                               "text", param)
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
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                          tokenize=True, return_dict=False,
                                          **(req.chat_template_kwargs or {}))
        except Exception as e:       # jinja2's TemplateError, UndefinedError, ... of the template
            raise RequestError(f"the chat template cannot render messages ({type(e).__name__}: "
                               f"{e})", "messages") from None
        return [list(ids)]
