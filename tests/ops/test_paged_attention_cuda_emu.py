"""The CUDA decode kernel's logic, run on the CPU against ops/reference.py.

csrc/cuda/paged_attention.cu is compiled as C++ with the stand-ins in tests/ops/cuda_emu (a CTA
runs as 128 threads with barriers for __syncthreads and the warp shuffles), so its indexing,
chunking, splits, reduce, GQA head groups and masking are checked on machines without a GPU.
What the emulation cannot show (speed, coalescing, compiler-specific behaviour) the `gpu` tests in
test_paged_attention_triton.py cover on a GPU.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cb_kernels import _C
from cb_kernels.ops._backend import DTYPE_CODES
from cb_kernels.ops.reference import ref_paged_attention
from paged_attention_cases import Case, build

ROOT = Path(__file__).resolve().parents[2]
LAUNCHES = {
    "decode_kernel<T, HEAD_DIM><<<grid, kThreads, 0, stream>>>(p);":
        "emu_launch(decode_kernel<T, HEAD_DIM>, grid, kThreads, p);",
    "reduce_kernel<T><<<reduce_grid, kThreads, 0, stream>>>(p);":
        "emu_launch(reduce_kernel<T>, reduce_grid, kThreads, p);",
}
ENTRY = """
extern "C" const char* emu_paged_attention_decode(const cbk::PagedAttentionParams* p) {
  return cbk::cuda::paged_attention_decode(*p, nullptr).message;
}
"""


class Params(ctypes.Structure):  # mirrors cbk::PagedAttentionParams
    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("q", "k_cache", "v_cache", "out", "block_tables",
                                        "seq_lens", "cu_seqlens_q", "part_out", "part_ml")]
        + [(n, ctypes.c_int64) for n in (
            "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size", "q_stride_token",
            "q_stride_head", "out_stride_token", "out_stride_head", "k_stride_block",
            "k_stride_token", "k_stride_head", "v_stride_block", "v_stride_token",
            "v_stride_head", "block_table_stride", "max_splits")]
        + [("dtype", ctypes.c_int32), ("scale", ctypes.c_float), ("sliding_window", ctypes.c_int32),
           ("softcap", ctypes.c_float), ("all_decode", ctypes.c_bool)]
        + [(n, ctypes.c_int64) for n in ("num_tokens", "num_blocks", "max_blocks_per_seq")]
        + [("sinks", ctypes.c_void_p)])


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to build the emulated CUDA kernel")
    src = (ROOT / "csrc/cuda/paged_attention.cu").read_text()
    for launch, call in LAUNCHES.items():
        assert src.count(launch) == 1, f"launch changed in paged_attention.cu: {launch}"
        src = src.replace(launch, call)
    out = tmp_path_factory.mktemp("cuda_emu")
    (out / "paged_attention_emu.cpp").write_text(src + ENTRY)
    lib = out / "libpaged_attention_emu.so"
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                        f"-I{ROOT / 'tests/ops/cuda_emu'}", f"-I{ROOT / 'csrc/include'}",
                        str(out / "paged_attention_emu.cpp"), "-o", str(lib)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    dll = ctypes.CDLL(str(lib))
    dll.emu_paged_attention_decode.restype = ctypes.c_char_p
    return dll


def run_emulated(dll, c: Case, sinks=None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(out, reference, rows the kernel owns: q_len == 1 ones, or every row at num_tokens <=
    num_seqs, where the launcher starts no prefill kernel)."""
    q, k_cache, v_cache, bt, seq_lens, cu = build(c)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, max_blocks = bt.shape
    out = torch.full_like(q, float("nan"))
    span = max_blocks * c.block_size if c.sliding_window is None else min(max_blocks * c.block_size,
                                                                   c.sliding_window)
    max_splits = _C.paged_attention_cuda_max_splits(span)
    part_out = torch.full((num_seqs, num_heads, max_splits, head_dim), float("nan"))
    part_ml = torch.full((num_seqs, num_heads, max_splits, 2), float("nan"))
    p = Params(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bt.data_ptr(),
               seq_lens.data_ptr(), cu.data_ptr(), part_out.data_ptr(), part_ml.data_ptr(),
               num_seqs, num_heads, k_cache.shape[2], head_dim, c.block_size, q.stride(0),
               q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
               *v_cache.stride()[:3], bt.stride(0), max_splits, DTYPE_CODES[c.dtype],
               head_dim ** -0.5, c.sliding_window or 0, c.softcap or 0.0, num_tokens <= num_seqs,
               0, 0, 0, sinks.data_ptr() if sinks is not None else None)
    err = dll.emu_paged_attention_decode(ctypes.byref(p))
    assert err is None, err.decode()
    ref = ref_paged_attention(q, k_cache, v_cache, bt, seq_lens, cu,
                              sliding_window=c.sliding_window, softcap=c.softcap, sinks=sinks)
    q_lens = (cu[1:] - cu[:-1]).tolist()
    rows = (list(range(num_tokens)) if num_tokens <= num_seqs
            else [int(cu[i]) for i, n in enumerate(q_lens) if n == 1])
    return out, ref, rows


# ~0.5-8 s each: the emulation starts 128 threads per CTA.
CASES = [
    Case("decode-1", seq_lens=(1,), q_lens=(1,), num_heads=4),
    Case("gqa2-d64-fp32-splits", seq_lens=(17, 63, 300), q_lens=(1, 1, 1), num_heads=4),
    Case("gqa8-d128-bf16-splits", seq_lens=(1000, 70), q_lens=(1, 1), num_heads=8, num_kv_heads=1,
         head_dim=128, dtype=torch.bfloat16),
    Case("gqa16-d256-fp16-bs256", seq_lens=(300, 30), q_lens=(1, 1), num_heads=16, num_kv_heads=1,
         head_dim=256, block_size=256, dtype=torch.float16),
    Case("gqa6-d96-bs8", seq_lens=(280, 9), q_lens=(1, 1), num_heads=6, num_kv_heads=1,
         head_dim=96, block_size=8),
    Case("gqa1-d80-bf16", seq_lens=(520,), q_lens=(1,), num_heads=2, num_kv_heads=2, head_dim=80,
         dtype=torch.bfloat16),
    Case("window-softcap", seq_lens=(1100, 5), q_lens=(1, 1), num_heads=4, sliding_window=300,
         softcap=5.0),
    Case("kv-per-token-views", seq_lens=(100, 30), q_lens=(1, 1), num_heads=4,
         kv_layout="kv-per-token"),
    Case("mixed-decode-rows", seq_lens=(63, 17, 400), q_lens=(1, 5, 1), num_heads=4),
    Case("qlen0-all-decode", seq_lens=(5, 30, 40), q_lens=(0, 2, 1), num_heads=4),
    Case("qlen0-fewer-tokens-than-seqs", seq_lens=(5, 7, 9, 12, 20), q_lens=(0, 0, 0, 1, 3),
         num_heads=4),
    Case("qlen0-window", seq_lens=(600, 0), q_lens=(2, 0), num_heads=4, sliding_window=100),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_emulated_cuda_decode_matches_reference(emulated, c):
    out, ref, rows = run_emulated(emulated, c)
    assert rows
    assert not out[rows].isnan().any()
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), **c.tolerance)


# Attention sinks: one split, several splits with their merge, with a window and softcap.
SINK_CASES = [c for c in CASES if c.id in ("decode-1", "gqa2-d64-fp32-splits", "window-softcap")]


@pytest.mark.parametrize("c", SINK_CASES, ids=lambda c: c.id)
def test_emulated_cuda_decode_with_sinks_matches_reference(emulated, c):
    sinks = torch.randn(c.num_heads, generator=torch.Generator().manual_seed(3)) * 2.0 + 4.0
    out, ref, rows = run_emulated(emulated, c, sinks)
    assert not out[rows].isnan().any()
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), **c.tolerance)
