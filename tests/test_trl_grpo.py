"""TRL's GRPOTrainer (TRL 1.16, the test extra) training a tiny random Llama for 3 steps on CPU,
offline, with its rollouts from cb_kernels by the two routes that need no fork of TRL:

- `rollout_func` backed by an Engine on the model being trained (colocated): the optimizer's
  in-place steps are followed (the parameters change, greedy tokens after training equal
  `model.generate`'s) and every rollout's logprobs equal a forward pass's with the weights of
  that moment (fp32, within 1e-4);
- `use_transformers_continuous_batching=True` with `cb_kernels.hf.enable(model)`: TRL's
  `model.generate_batch` calls run on our paged attention (a spy counts the calls).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import VOCAB, make_tokenizer, reference_tokens

G = 2                    # completions per prompt (num_generations)
NEW = 6                  # tokens per completion
STEPS = 3


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")      # rollout_func's notice


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model


def _tokenizer():
    tok = make_tokenizer()
    tok.pad_token, tok.eos_token = "<unk>", "w2"       # ids 0 and 2
    return tok


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{t}" for t in torch.randint(3, VOCAB, (n,), generator=g).tolist())
               for n in (4, 7, 5, 9, 6, 3, 8, 5)]
    return Dataset.from_dict({"prompt": prompts})


def _spread(completion_ids, **_) -> list:
    """A reward that differs between samples (so the advantages and the gradient are not 0)."""
    return [-abs(sum(ids) / len(ids) - VOCAB / 2) / VOCAB for ids in completion_ids]


def _config(tmp_path, **kw):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                      num_generations=G, max_completion_length=NEW, learning_rate=1e-2,
                      beta=0.0, temperature=1.0, bf16=False, use_cpu=True, report_to="none",
                      save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
                      disable_tqdm=True, **kw)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _forward_logprobs(model, prompt, completion) -> list:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_grpo_rollout_func_on_an_engine_over_the_trained_model(tmp_path):
    from trl import GRPOTrainer

    from cb_kernels import Engine, EngineConfig, SamplingParams

    model, tok = _model(), _tokenizer()
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64), tokenizer=tok)
    params = SamplingParams(n=G, temperature=1.0, max_new_tokens=NEW, logprobs=0,
                            logprobs_mode="processed", ignore_eos=True)
    rounds = []

    def rollout(prompts, trainer):
        # each prompt arrives G times in a row: one request with n=G per distinct prompt
        outs = engine.generate(prompts[::G], params)
        prompt_ids, completion_ids, logprobs = [], [], []
        for out in outs:
            for o in out.outputs:
                prompt_ids.append(out.prompt_token_ids)
                completion_ids.append(o.token_ids)
                logprobs.append([e[t] for t, e in zip(o.token_ids, o.logprobs)])
        worst = max(abs(a - b) for p, c, lps in zip(prompt_ids, completion_ids, logprobs)
                    for a, b in zip(lps, _forward_logprobs(model, p, c)))
        rounds.append((outs[0].weight_version, worst))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    before = _params(model)
    trainer = GRPOTrainer(model=model, reward_funcs=_spread, args=_config(tmp_path),
                          train_dataset=_dataset(), processing_class=tok, rollout_func=rollout)
    trainer.train()

    assert len(rounds) == STEPS
    assert all(worst < 1e-4 for _, worst in rounds), rounds          # fp32 engine vs forward
    versions = [v for v, _ in rounds]
    assert versions == sorted(set(versions)), versions               # a new version each round
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), set(before) - set(changed)
    model.eval()
    prompts = [tok(p)["input_ids"] for p in _dataset()["prompt"][:4]]
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                      ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == reference_tokens(model, prompts, NEW)


def test_grpo_transformers_continuous_batching_runs_on_our_attention(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    import cb_kernels.hf
    from cb_kernels import ops
    from cb_kernels.hf import dropin

    try:
        dropin.check_version()
    except RuntimeError as e:           # transformers 5.17 (the floor): refused by design
        pytest.skip(f"the drop-in refuses this transformers: {e}")
    calls = []
    real = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, tok = _model(), _tokenizer()
    cb_kernels.hf.enable(model)
    try:
        before = _params(model)
        config = _config(tmp_path, use_transformers_continuous_batching=True,
                         transformers_continuous_batching_config={
                             "page_size": 16, "num_blocks": 64, "max_batch_tokens": 64})
        trainer = GRPOTrainer(model=model, reward_funcs=_spread, args=config,
                              train_dataset=_dataset(), processing_class=tok)
        trainer.train()
    finally:
        cb_kernels.hf.disable()
    # every layer of every generate_batch step: 3 rounds x >= NEW steps x 2 layers
    assert len(calls) >= STEPS * NEW * 2, len(calls)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
