"""compute-sanitizer memcheck and racecheck over one small call of every CUDA kernel (decode
attention and its split reduce, write_kv, copy_blocks, the swap paths), where the tool is on the
machine. Each tool runs one fresh process: ~1 minute, most of it torch's start-up under the tool."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import torch
from cb_kernels import ops
from cb_kernels.ops.swap_blocks import _swap_blocks

torch.manual_seed(0)
dev = "cuda"
k = torch.randn(12, 16, 2, 64, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32, device=dev)
lens = torch.tensor([61, 30], dtype=torch.int32, device=dev)
cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
q = torch.randn(2, 8, 64, device=dev, dtype=torch.bfloat16)
ops.paged_attention(q, k, v, tables, lens, cu, backend="cuda")                # one split
long_k = torch.randn(80, 16, 2, 64, device=dev, dtype=torch.bfloat16)
long_t = torch.arange(80, dtype=torch.int32, device=dev).view(1, 80)
ops.paged_attention(q[:1], long_k, long_k, long_t, torch.tensor([1280], dtype=torch.int32,
                    device=dev), cu[:2], backend="cuda")                        # splits + reduce
slots = torch.tensor([5, 17, -1, 40], device=dev)
ops.write_kv(torch.randn(4, 2, 64, device=dev, dtype=torch.bfloat16),
             torch.randn(4, 2, 64, device=dev, dtype=torch.bfloat16), k, v, slots, backend="cuda")
ops.copy_blocks([k], [v], torch.tensor([[1, 4], [7, 8]]), backend="cuda")
host = ops.HostPool([k, v], 6)
mapping = torch.tensor([[3, 0], [9, 5]])
for method in ("kernel", "batch", "memcpy"):
    _swap_blocks([k, v], host.caches, mapping, stream=None, backend="cuda", cuda_method=method)
    _swap_blocks(host.caches, [k, v], torch.tensor([[0, 10], [5, 11]]), stream=None,
                 backend="cuda", cuda_method=method)
torch.cuda.synchronize()
print("ran")
"""


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    for d in ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer"):
        if found is None and os.path.exists(f"{d}/compute-sanitizer"):
            found = f"{d}/compute-sanitizer"
    return found


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_cuda_kernels_are_clean_under_compute_sanitizer(tool):
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer is not installed on this machine")
    out = subprocess.run([exe, "--tool", tool, "--error-exitcode", "9", sys.executable, "-c",
                          SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "ran" in out.stdout, text[-4000:]
    assert "ERROR SUMMARY: 0 errors" in text or "RACECHECK SUMMARY: 0 hazards" in text, text[-4000:]
