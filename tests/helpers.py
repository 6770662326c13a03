"""Tiny random transformers models and the reference they are checked against."""
from __future__ import annotations

import os

import torch

VOCAB = 500
# CBK_TEST_ATTN_BACKEND=torch runs the engine tests on the reference attention (for bisecting).
ATTN_BACKEND = os.environ.get("CBK_TEST_ATTN_BACKEND") or None


def _finish(model):
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_model(kind: str = "llama", seed: int = 0, **overrides):
    """A 2-layer random model of the given family with a 500-token vocabulary (fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    families = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 24}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   {"head_dim": 16, "sliding_window": 24, "attn_logit_softcapping": 5.0,
                    "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                   {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    }
    cfg_cls, model_cls, extra = families[kind]
    kwargs = {**common, **extra, **overrides}
    attn = "eager" if kind.startswith("gemma") else "sdpa"   # what transformers recommends
    return _finish(model_cls(cfg_cls(**kwargs, attn_implementation=attn)))


def random_prompts(lengths, seed: int = 0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def reference_tokens(model, prompts, max_new_tokens):
    """Greedy tokens of transformers' generate, one prompt at a time (no padding)."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    out = []
    for p, n in zip(prompts, max_new_tokens):
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def run_checked(engine, on_step=None, max_steps: int = 100_000):
    """Step `engine` until idle, calling check_invariants() after every step; returns outputs by
    request id."""
    outputs = {}
    for i in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_invariants()
        if on_step is not None:
            on_step(i)
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps: {engine.stats()}")
    for out in engine.step():     # cancellations after the last step
        outputs[out.request_id] = out
    return outputs


def make_tokenizer():
    """A 500-word whitespace tokenizer (ids match the tiny models' vocabulary), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def fail_nth_model_run(monkeypatch, runner, n: int, message: str = "injected kernel failure"):
    """Makes the runner's n-th step (1-based `execute` call) raise RuntimeError(message)."""
    calls = [0]
    real = runner.execute

    def execute(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)


def make_byte_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer (every text encodes; ids below the tiny models' vocabulary),
    trained offline on a few JSON-like lines; "<eos>" is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": true}',
              '{"id": 7, "kind": "list", "items": [1, 2, 3], "valid": false, "note": null}',
              "the quick brown fox jumps over the lazy dog 0123456789"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def assert_same_at_threads(run, state, threads=(1, 2)):
    """Runs `run(s)` on a fresh copy `s` of `state` at each torch thread count and asserts the
    outputs and the written states are bit-identical (a stateful kernel's threads split work, never
    the sums); restores the thread count."""
    saved = torch.get_num_threads()
    results = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            s = state.clone()
            results.append((run(s), s))
    finally:
        torch.set_num_threads(saved)
    first_out, first_state = results[0]
    for out, s in results[1:]:
        assert torch.equal(out, first_out) and torch.equal(s, first_state)
