"""What the tests of the stateful conv and scan share (test_causal_conv1d.py,
test_selective_scan.py): the CPU bodies they force, a case's variable-length batch, and the
sm_90 compile of their Triton kernels in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from cb_kernels import _C

# The kernels' CPU bodies that this machine runs (csrc/cpu: portable, and avx512 where it exists).
BODIES = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx512")]


def varlen_batch(rows, num_slots: int, gen: torch.Generator):
    """(slots int64 [num_seqs], distinct, drawn from `gen`; cu_seqlens int32 [num_seqs + 1];
    has_state bool [num_seqs]) of a case's rows [(row length, continues from its slot)]."""
    slots = torch.randperm(num_slots, generator=gen)[:len(rows)]
    cu_seqlens = torch.tensor([0] + [length for length, _ in rows]).cumsum(0).to(torch.int32)
    has_state = torch.tensor([c for _, c in rows], dtype=torch.bool)
    return slots, cu_seqlens, has_state


# The head of every sm_90 script: `sm90(kernel, signature, constexprs, **options)` compiles for
# an H100 with triton's bundled ptxas and gives the kernel and cuobjdump's REG / LOCAL (spilled
# bytes) words of its cubin.
_SM90_HEAD = """
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sm90(kernel, sig, const, **options):
    k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([_TOOL, "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    return k, [w for w in usage.split() if w.startswith(("REG:", "LOCAL:"))]
"""


def compile_sm90(script: str, cache_dir) -> list[str]:
    """The lines `script` prints, run after the head above in a fresh process without
    TRITON_INTERPRET (no GPU needed), its Triton cache in `cache_dir`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", _SM90_HEAD + script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()
