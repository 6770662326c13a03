"""Triton- and CUDA-specific checks of paged_attention against ops/reference.py.

On a machine without a GPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py)
and the CUDA kernel is only compiled; the `gpu`-marked tests run both on a GPU, including a CUDA
graph captured once and replayed with longer sequences.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from cb_kernels.ops import paged_attention
from cb_kernels.ops.reference import ref_paged_attention
from paged_attention_cases import Case, build, kwargs, tolerance

def check(c: Case, backend: str, device="cpu") -> None:
    args = build(c, device)
    out = paged_attention(*args, backend=backend, **kwargs(c))
    ref = ref_paged_attention(*[a.cpu() for a in args], **kwargs(c))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().float(), ref.float(), **c.tolerance)


# Each runs in ~0.1-1 s under the interpreter.
TRITON_CASES = [
    Case("decode-1", seq_lens=(1,), q_lens=(1,), num_heads=4),
    Case("mixed-decode-prefill-chunk", seq_lens=(63, 17, 40, 1000), q_lens=(1, 17, 5, 1),
         num_heads=4),
    Case("gqa1-bs8-d80", seq_lens=(30, 60), q_lens=(1, 9), num_heads=3, num_kv_heads=3,
         head_dim=80, block_size=8),
    Case("gqa3-d96-bf16", seq_lens=(300, 50), q_lens=(1, 6), num_heads=6, num_kv_heads=2,
         head_dim=96, dtype=torch.bfloat16),
    Case("gqa8-d128-fp16", seq_lens=(520, 70), q_lens=(1, 3), num_heads=8, num_kv_heads=1,
         head_dim=128, block_size=32, dtype=torch.float16),
    Case("gqa16-d256-bs256", seq_lens=(700, 300), q_lens=(1, 4), num_heads=16, num_kv_heads=1,
         head_dim=256, block_size=256),
    Case("window-softcap", seq_lens=(1100, 90, 5), q_lens=(1, 8, 1), num_heads=4,
         sliding_window=50, softcap=5.0),
    Case("window-1", seq_lens=(40, 9), q_lens=(1, 3), num_heads=4, sliding_window=1),
    Case("kv-per-token-views", seq_lens=(100, 30), q_lens=(1, 7), num_heads=4,
         kv_layout="kv-per-token"),
    Case("qlen0-all-decode-shape", seq_lens=(5, 30, 40), q_lens=(0, 2, 1),
         num_heads=4),   # num_tokens == num_seqs
    Case("qlen0-window", seq_lens=(600, 0), q_lens=(2, 0), num_heads=4, sliding_window=100),
    Case("qlen0-fewer-tokens-than-seqs", seq_lens=(5, 7, 9, 12, 20), q_lens=(0, 0, 0, 1, 3),
         num_heads=4),   # num_tokens < num_seqs: no prefill launch, the decode one covers all
]


@pytest.mark.parametrize("c", TRITON_CASES, ids=lambda c: c.id)
def test_triton_matches_reference(c):
    check(c, "triton")


def test_triton_split_path_forced(monkeypatch):
    """Splits of 64 keys: short sequences exercise the partials and the reduce."""
    import cb_kernels.triton.paged_attention as tpa
    monkeypatch.setattr(tpa, "SPLIT_MIN", 64)
    monkeypatch.setattr(tpa, "MAX_SPLITS", 4)
    check(Case("split", seq_lens=(65, 200, 1000, 300), q_lens=(1, 1, 1, 4), num_heads=8,
               num_kv_heads=2), "triton")
    check(Case("split-window", seq_lens=(400, 100), q_lens=(1, 1), num_heads=4,
               sliding_window=150, softcap=3.0), "triton")


def test_triton_decode_is_batch_invariant():
    """A decode's output does not depend on what shares its batch (engine rule): bit-identical
    alone and next to a prefill, a chunked prefill and other decodes."""
    c = Case("mix", seq_lens=(10, 700, 20, 33), q_lens=(3, 1, 20, 1), num_heads=4)
    q, k_cache, v_cache, bt, seq_lens, cu = build(c)
    out_all = paged_attention(q, k_cache, v_cache, bt, seq_lens, cu, backend="triton")
    one = torch.tensor([0, 1], dtype=torch.int32)
    out_one = paged_attention(q[3:4], k_cache, v_cache, bt[1:2], seq_lens[1:2], one,
                              backend="triton")
    assert torch.equal(out_all[3], out_one[0])


def test_triton_launcher_reads_no_device_values(monkeypatch):
    """CUDA graphs need launches whose grid and arguments come from shapes only: with the kernels
    replaced by recorders, the launcher runs with every tensor-to-host read raising."""
    import cb_kernels.triton.paged_attention as tpa
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, kw.get("IS_DECODE")))

    monkeypatch.setattr(tpa, "_paged_attention_kernel", Recorder("attention"))
    monkeypatch.setattr(tpa, "_reduce_splits_kernel", Recorder("reduce"))
    c = Case("mixed", seq_lens=(63, 17, 40, 1000), q_lens=(1, 17, 5, 1), num_heads=4)
    q, k_cache, v_cache, bt, seq_lens, cu = build(c)

    def no_host_read(*args, **kw):
        raise AssertionError("the launcher read a tensor value on the host")

    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_host_read)
    tpa.paged_attention_triton(q, k_cache, v_cache, bt, seq_lens, cu, torch.empty_like(q),
                               0.125, 600, 30.0)
    monkeypatch.undo()
    num_tokens, num_seqs, block_q = q.shape[0], bt.shape[0], 64 // 2
    splits = min(tpa.MAX_SPLITS, math.ceil(min(bt.shape[1] * c.block_size, 600) / tpa.SPLIT_MIN))
    assert splits == 3
    assert launches == [("attention", (num_tokens // block_q + num_seqs, 2, 1), False),
                        ("attention", (num_seqs, 2, splits), True),
                        ("reduce", (num_seqs, 4), None)]


def test_triton_pool_over_32768_blocks():
    """Block ids above 32768 with 64 KiB-element blocks: offsets pass 2**31 elements (int64 math).
    The pool is a lazily-committed allocation: only the touched blocks get memory."""
    num_blocks, block_size, kvh, head_dim = 33000, 16, 1, 64
    stride_b = 65536   # elements per block (as for 32 kv heads x 128 dims)
    base = torch.empty(num_blocks * stride_b, dtype=torch.float16)
    shape = (num_blocks, block_size, kvh, head_dim)
    strides = (stride_b, kvh * head_dim, head_dim, 1)
    k_cache = base.as_strided(shape, strides)
    v_cache = base.as_strided(shape, strides, storage_offset=block_size * kvh * head_dim)
    g = torch.Generator().manual_seed(1)
    seq_lens = torch.tensor([40, 1], dtype=torch.int32)
    bt = torch.tensor([[32999, 32800, 32769], [32770, 0, 0]], dtype=torch.int32)
    for s, n in enumerate(seq_lens.tolist()):
        for j in range(math.ceil(n / block_size)):
            k_cache[bt[s, j]] = torch.randn(block_size, kvh, head_dim, generator=g).half()
            v_cache[bt[s, j]] = torch.randn(block_size, kvh, head_dim, generator=g).half()
    q = torch.randn(3, 2, head_dim, generator=g).half()
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    out = paged_attention(q, k_cache, v_cache, bt, seq_lens, cu, backend="triton")
    ref = ref_paged_attention(q, k_cache, v_cache, bt, seq_lens, cu)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(torch.float16))


_AOT_SCRIPT = r"""
import subprocess, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import cb_kernels.triton.paged_attention as pa

fn = pa._paged_attention_kernel
bin_dir = __import__("os").path.dirname(triton.__file__) + "/backends/nvidia/bin"
# What the JIT specialises on a GPU for these shapes: pointers and strides that are multiples
# of 16 (every supported head_dim is) get the divisibility hint.
div16 = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "bt_ptr", "seq_lens_ptr", "cu_q_ptr",
         "part_out_ptr", "part_ml_ptr", "stride_qt", "stride_qh", "stride_kb", "stride_kt",
         "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
         "stride_bt", "num_heads"}
for dt, is_decode, group, head_dim in [("bf16", True, 8, 128), ("bf16", False, 8, 128),
                                       ("fp16", False, 1, 256), ("fp32", True, 4, 80),
                                       ("fp32", False, 8, 128)]:
    pad = pa._next_pow2(head_dim)
    block_m, block_q, tile_n = pa._tiles(group, pad, is_decode, True, dt == "fp32")
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + dt for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")})
    sig.update({n: "*i32" for n in ("bt_ptr", "seq_lens_ptr", "cu_q_ptr")})
    sig.update({"part_out_ptr": "*fp32", "part_ml_ptr": "*fp32", "sinks_ptr": "*fp32",
                "scale": "fp32",
                "softcap": "fp32", "stride_kb": "i64", "stride_vb": "i64"})
    const = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, BLOCK_SIZE=16, GROUP=group, BLOCK_M=block_m,
                 BLOCK_Q=block_q, TILE_N=tile_n, IS_DECODE=is_decode, ALL_DECODE=is_decode,
                 USE_WINDOW=True, USE_SOFTCAP=True, SPLIT_MIN=pa.SPLIT_MIN,
                 MAX_SPLITS=pa.MAX_SPLITS, DOT_FP32=False, USE_SINKS=True,
                 DOT_PRECISION="tf32x3" if dt == "fp32" else "tf32",
                 stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)
    sig.update({k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4 if pad <= 128 else 8})
    path = "/tmp/cbk_attn_%d.cubin" % __import__("os").getpid()
    open(path, "wb").write(k.asm["cubin"])
    usage = subprocess.run([bin_dir + "/cuobjdump", "-res-usage", path], capture_output=True,
                           text=True, check=True).stdout
    print(dt, is_decode, group, head_dim, [l.strip() for l in usage.splitlines() if "REG:" in l])
"""


def test_triton_kernel_compiles_for_sm90_without_spills():
    """The GPU path (native bf16 dots, tf32x3, no interpreter) compiles for an H100/H200 with no
    register spills, checked without a GPU: triton.compile for sm_90 + cuobjdump."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this triton install has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 5, r.stdout
    for line in lines:
        assert "STACK:0 " in line, line


# ---- The "cuda" backend's host side: runs everywhere.

def test_cuda_backend_argument_checks():
    from cb_kernels.ops.paged_attention.cuda import check_cuda_args
    c = Case("ok", seq_lens=(20,), q_lens=(1,), num_heads=4, head_dim=64)
    q, k_cache, v_cache, *_ = build(c)
    check_cuda_args(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="head_dim"):
        check_cuda_args(q[..., :48], k_cache[..., :48], v_cache[..., :48])
    with pytest.raises(ValueError, match="power-of-two block_size"):
        check_cuda_args(q, k_cache[:, :12], v_cache[:, :12])
    with pytest.raises(ValueError, match="16-byte aligned rows in k_cache"):
        shifted = torch.empty(k_cache.numel() + 1, dtype=k_cache.dtype)[1:].view(k_cache.shape)
        check_cuda_args(q, shifted, v_cache)


def test_cuda_split_bound_is_monotone_and_capped():
    from cb_kernels import _C
    bounds = [_C.paged_attention_cuda_max_splits(n) for n in range(0, 40000, 37)]
    assert bounds == sorted(bounds) and bounds[0] == 1 and max(bounds) == 32
    assert _C.paged_attention_cuda_max_splits(256) == 1
    assert _C.paged_attention_cuda_max_splits(257) == 2


def test_cuda_kernel_without_cuda_build_raises():
    from cb_kernels import _C
    if _C.build_info["cuda_compiled"]:
        pytest.skip("this build has CUDA kernels (the GPU tests cover them)")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        _C.paged_attention_cuda(*([0] * 9), 1, 1, 1, 64, 16, *([0] * 11), 1, 0, 1.0, 0, 0.0,
                                True, 0, 0)


# ---- GPU: the CUDA kernel and Triton on the device (skipped where no GPU exists).

GPU_CASES = [
    Case("decode-bf16-gqa8-d128", seq_lens=(1, 17, 63, 1000, 4097, 9000), q_lens=(1,) * 6,
         num_heads=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16),
    Case("mixed-fp16-d64-bs8", seq_lens=(63, 17, 40, 1000), q_lens=(1, 17, 5, 1), num_heads=8,
         num_kv_heads=2, block_size=8, dtype=torch.float16),
    Case("decode-fp32-d80-gqa1", seq_lens=(300, 2000), q_lens=(1, 1), num_heads=4, num_kv_heads=4,
         head_dim=80),
    Case("decode-bf16-d96-gqa6", seq_lens=(5, 700, 2600), q_lens=(1, 1, 1), num_heads=12,
         num_kv_heads=2, head_dim=96, block_size=64, dtype=torch.bfloat16),
    Case("decode-fp16-d256-gqa16-bs256", seq_lens=(10, 3000), q_lens=(1, 1), num_heads=16,
         num_kv_heads=1, head_dim=256, block_size=256, dtype=torch.float16),
    Case("window-softcap-bf16", seq_lens=(5000, 90, 3), q_lens=(1, 9, 1), num_heads=8,
         num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, sliding_window=700, softcap=30.0),
    Case("kv-per-token-qlen0", seq_lens=(5, 300, 40), q_lens=(0, 2, 1), num_heads=4,
         kv_layout="kv-per-token"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("c", GPU_CASES, ids=lambda c: c.id)
def test_gpu_backends_match_reference(c, backend):
    check(c, backend, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_decode_cuda_graph_replays_longer_sequences(backend):
    """Capture one decode step at short lengths, replay after the sequences grew (same block
    tables, longer seq_lens): the result matches the reference at the new lengths."""
    c = Case("graph", seq_lens=(3000,) * 4, q_lens=(1,) * 4, num_heads=16, num_kv_heads=2,
             head_dim=128, dtype=torch.bfloat16)
    q, k_cache, v_cache, bt, full_lens, cu = build(c, "cuda")
    seq_lens = torch.tensor([5, 40, 300, 1000], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    run = lambda: paged_attention(q, k_cache, v_cache, bt, seq_lens, cu, out=out, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()   # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ([6, 41, 301, 1001], [2999, 17, 3000, 2048]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = ref_paged_attention(*(t.cpu() for t in (q, k_cache, v_cache, bt, seq_lens, cu)))
        torch.testing.assert_close(out.cpu().float(), ref.float(), **c.tolerance)
