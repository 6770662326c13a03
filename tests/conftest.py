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


@pytest.fixture(autouse=True)
def _one_torch_thread_when_asked(request):
    """Tests marked `one_thread` compare tokens or timings: run them on one torch thread."""
    if "one_thread" not in request.keywords:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
