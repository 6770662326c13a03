"""Checks a request must pass before it is queued (each names the argument and the numbers), and
the RequestOutput of a request."""
from __future__ import annotations

from typing import Optional

from cb_kernels.engine.config import CompletionOutput, RequestOutput


def to_token_ids(prompt, tokenizer) -> list:
    """A prompt as a list of ints: token ids (list, tuple, 1-D tensor or array) or a string
    (needs the engine's tokenizer)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("prompt is a str but the Engine has no tokenizer: pass token ids, or "
                            "Engine(model, config, tokenizer=...)")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if hasattr(prompt, "tolist") and hasattr(prompt, "ndim"):   # torch tensor / numpy array
        if prompt.ndim != 1:
            raise ValueError(f"prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
        if getattr(prompt, "is_floating_point", lambda: False)() or \
                str(getattr(prompt, "dtype", "")).startswith(("float", "torch.float")):
            raise TypeError(f"prompt token ids must be integers, got dtype {prompt.dtype}")
        if getattr(getattr(prompt, "device", None), "type", None) == "meta":
            raise TypeError("prompt is a tensor on the meta device, which holds no values")
        try:
            prompt = prompt.tolist()
        except (RuntimeError, NotImplementedError) as e:
            raise TypeError(f"prompt tensor cannot be read as token ids ({e})") from None
    if not isinstance(prompt, (list, tuple)):
        raise TypeError("prompt must be a list of token ids or a str, got "
                        f"{type(prompt).__name__}")
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"prompt[{i}] must be an int token id, got {type(t).__name__}")
    return list(prompt)


def check_params(params, vocab_size: int, tokenizer) -> None:
    """SamplingParams checked again (a field may have changed since it was built) and against
    the model and tokenizer."""
    params.validate()
    params.check_vocab(vocab_size)
    if params.stop is not None and tokenizer is None:
        raise ValueError("stop strings need the Engine's tokenizer: Engine(model, config, "
                         "tokenizer=...), or use stop_token_ids")


def check_prompt(token_ids: list, params, vocab_size: int, max_positions: int,
                 block_manager) -> None:
    if not token_ids:
        raise ValueError("prompt is empty: a request needs at least one token")
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    for t in getattr(params, "stop_token_ids", ()):
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size})")
    n, new = len(token_ids), params.max_new_tokens
    if n > max_positions:
        raise ValueError(f"prompt has {n} tokens, more than the model's max_position_embeddings "
                         f"({max_positions})")
    if n + new - 1 > max_positions:   # the last sampled token is never fed back
        raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({new}) needs {n + new - 1} "
                         f"positions, more than the model's max_position_embeddings "
                         f"({max_positions}); lower max_new_tokens")
    bs, total = block_manager.block_size, block_manager.num_blocks
    needed = block_manager.blocks_for(n + new - 1)
    if needed > total:
        raise ValueError(
            f"request can never fit the KV pool: prompt ({n} tokens) + max_new_tokens ({new}) "
            f"needs {needed} blocks of {bs} tokens, the pool has {total} blocks "
            f"({total * bs} tokens); raise EngineConfig.num_blocks or lower max_new_tokens")


def error_output(request_id: str, prompt, error: Exception) -> RequestOutput:
    prompt_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
    return RequestOutput(request_id, prompt_ids, [], None, "error",
                         f"{type(error).__name__}: {error}")


def completion_of(seq, token_ids: list, tokenizer, text: Optional[str] = None) -> CompletionOutput:
    """The CompletionOutput of one sample holding `token_ids` (its text decoded unless given;
    with stop strings, the detokenized text cut at the match)."""
    if text is None and tokenizer is not None:
        # Only stop strings' detokenizer is fed every token (a stream's is fed per delta).
        text = seq.detokenizer.text if seq.detokenizer is not None and seq.detokenizer.stop \
            and len(token_ids) == seq.num_generated_tokens else \
            tokenizer.decode(token_ids, skip_special_tokens=True)
    logprobs = None if seq.logprobs is None else list(seq.logprobs[-len(token_ids):]) \
        if token_ids else []
    return CompletionOutput(seq.sample_index, list(token_ids), text, seq.finish_reason,
                            seq.stop_reason, logprobs, seq.cumulative_logprob)


def output_of(seq, token_ids: list, tokenizer, text: Optional[str] = None):
    """The RequestOutput of `seq` holding `token_ids` (its text decoded unless given). For a
    request with n > 1 samples: None until its last sample ended, then the output of all."""
    completion = completion_of(seq, token_ids, tokenizer, text)
    group, root = seq.group, seq
    outputs = [completion]
    if group is not None:
        group.outputs[seq.sample_index] = completion
        if len(group.outputs) < group.expected():
            return None
        outputs = [group.outputs[i] for i in sorted(group.outputs)]
        root = group.root
    first = outputs[0]
    error = next((s.error for s in (group.samples if group else [seq]) if s.error), None)
    return RequestOutput(root.request_id, root.prompt_token_ids, first.token_ids, first.text,
                         first.finish_reason, error, root.metrics, outputs, root.prompt_logprobs)


def delta_of(seq, token_ids: list, tokenizer, text: Optional[str]) -> RequestOutput:
    """A stream delta of one sample (outputs holds that sample alone, with its index)."""
    c = completion_of(seq, token_ids, tokenizer, text)
    root = seq.group.root if seq.group is not None else seq
    return RequestOutput(root.request_id, root.prompt_token_ids, c.token_ids, c.text,
                         c.finish_reason, seq.error, seq.metrics, [c], root.prompt_logprobs)
