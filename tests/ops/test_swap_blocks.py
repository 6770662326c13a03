"""swap_blocks and HostPool: every backend against ops/reference.py's ref_swap_blocks, bit for
bit, as an offload round trip through a NaN-filled host pool; the registered op; every bad input
names its argument."""
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cb_kernels import _C, ops
from cb_kernels.ops.reference import ref_swap_blocks
from cb_kernels.ops.swap_blocks import _swap_blocks
from kv_pools import DTYPE_IDS, DTYPES, make_pool, nan_empty, random_like_dtype, same_bits


def _round_trip(backend, dtype, interleaved, device="cpu", cuda_method="auto", stream=None):
    """Offload shuffled blocks to a NaN-filled HostPool, overwrite them on the device, restore them
    into other ids, and compare every byte."""
    k_caches, v_caches = make_pool(3, 24, 16, 2, 32, dtype, interleaved=interleaved, device=device)
    device_caches = k_caches + v_caches
    host = ops.HostPool(device_caches, 10)
    for t in host.caches:
        t.fill_(float("nan"))
    g = torch.Generator().manual_seed(1)
    dev_ids = torch.randperm(24, generator=g)[:6]          # shuffled, non-contiguous
    host_ids = torch.randperm(10, generator=g)[:6]
    snapshot = [t[dev_ids].cpu() for t in device_caches]
    def swap(src, dst, m):
        if stream is not None:  # the pools were written on the current stream
            stream.wait_stream(torch.cuda.current_stream())
        _swap_blocks(src, dst, m, stream=stream, backend=backend, cuda_method=cuda_method)
    swap(device_caches, host.caches, torch.stack([dev_ids, host_ids], 1))
    if device != "cpu":
        torch.cuda.synchronize()
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[host_ids] = False
    for t, snap in zip(host.caches, snapshot):
        assert same_bits(t[host_ids], snap)
        assert bool(torch.isnan(t[untouched].float()).all()), "a host block outside the mapping was written"
    for t in device_caches:
        t[dev_ids] = random_like_dtype(*t[dev_ids].shape, dtype=dtype, device=device)
    restore_ids = torch.tensor([x for x in range(24) if x not in dev_ids.tolist()][:6])[torch.randperm(6, generator=g)]
    swap(host.caches, device_caches, torch.stack([host_ids, restore_ids], 1))
    if device != "cpu":
        torch.cuda.synchronize()
    for t, snap in zip(device_caches, snapshot):
        assert same_bits(t[restore_ids].cpu(), snap)
    return host


@pytest.mark.parametrize("interleaved", [False, True], ids=["packed", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cpu", "torch", None])
def test_swap_round_trip_is_bit_exact(backend, dtype, interleaved):
    host = _round_trip(backend, dtype, interleaved)
    assert host.pinned is torch.cuda.is_available()


def test_swap_matches_reference_between_pools_of_different_sizes():
    src = make_pool(2, 7, 4, 2, 8, torch.float32, interleaved=False)[0]
    dst = [nan_empty(30, 4, 2, 8) for _ in range(2)]
    want = [t.clone() for t in dst]
    mapping = torch.tensor([[6, 29], [0, 3], [3, 0]])
    ref_swap_blocks(src, want, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert all(same_bits(a, b) for a, b in zip(dst, want))


def test_host_pool_layout_and_fallback_without_pinning(caplog):
    like = [nan_empty(8, 16, 2, 8, dtype=torch.bfloat16), nan_empty(8, 4, 3, dtype=torch.float32)]
    with caplog.at_level(logging.WARNING):
        pool = ops.HostPool(like, 5, pin_memory=True)
    assert [tuple(t.shape) for t in pool.caches] == [(5, 16, 2, 8), (5, 4, 3)]
    assert [t.dtype for t in pool.caches] == [torch.bfloat16, torch.float32]
    assert pool.block_nbytes == 16 * 2 * 8 * 2 + 4 * 3 * 4
    if not torch.cuda.is_available():
        assert pool.pinned is False and "pinned memory unavailable" in caplog.text
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in pool.caches)
    assert ends[0][1] <= ends[1][0], "the per-tensor views overlap"
    assert all(t.data_ptr() % 4096 == 0 for t in pool.caches)


def test_host_pools_register_whole_pages_so_two_pools_both_pin(monkeypatch):
    """A stand-in for the driver that pins whole pages and refuses a page pinned twice (as
    cudaHostRegister does): two small pools side by side must both pin, and the range each
    registers is the page-aligned span its views use."""
    pinned_pages, calls = set(), []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append((ptr, nbytes))
            pages = set(range(ptr // 4096, (ptr + nbytes - 1) // 4096 + 1))
            if pages & pinned_pages:
                return 712          # cudaErrorHostMemoryAlreadyRegistered
            pinned_pages.update(pages)
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    like = [nan_empty(8, 4, 2, 8), nan_empty(8, 4, 2, 8)]
    pools = [ops.HostPool(like, 3, pin_memory=True) for _ in range(4)]
    assert all(p.pinned for p in pools)
    for (ptr, nbytes), pool in zip(calls, pools):
        assert ptr % 4096 == 0 and nbytes % 4096 == 0
        assert ptr <= pool.caches[0].data_ptr() and \
            pool.caches[-1].data_ptr() + pool.caches[-1].nbytes <= ptr + nbytes


def test_registered_op_matches_reference_and_passes_opcheck():
    src = make_pool(2, 7, 4, 2, 8, torch.float32, interleaved=True)[0]
    dst = [nan_empty(5, 4, 2, 8) for _ in range(2)]
    want = [t.clone() for t in dst]
    mapping = torch.tensor([[6, 4], [0, 1]])
    ref_swap_blocks(src, want, mapping)
    torch.ops.cb_kernels.swap_blocks(src, dst, mapping, None, "cpu")
    assert all(same_bits(a, b) for a, b in zip(dst, want))
    torch.library.opcheck(torch.ops.cb_kernels.swap_blocks.default, (src, dst, mapping, None, "cpu"))


def test_registered_op_fake_checks_the_pools():
    with FakeTensorMode():
        src = [torch.empty(7, 4, 2, 8) for _ in range(2)]
        torch.ops.cb_kernels.swap_blocks(src, [torch.empty(5, 4, 2, 8) for _ in range(2)],
                                         torch.zeros(1, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match="blocks of shape"):
            torch.ops.cb_kernels.swap_blocks(src, [torch.empty(5, 4, 2, 4) for _ in range(2)],
                                             torch.zeros(1, 2, dtype=torch.int64))


def _bad_cases():
    kc, vc = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    m = torch.tensor([[0, 1]])
    host = [nan_empty(3, 4, 2, 8) for _ in range(4)]
    s = lambda mapping, dst=host, **kw: lambda: ops.swap_blocks(kc + vc, dst, mapping, **kw)  # noqa: E731
    return [
        ("swap-geometry", s(m, dst=[nan_empty(3, 4, 2, 4) for _ in range(4)]), ValueError, r"blocks of shape"),
        ("swap-dtype", s(m, dst=[nan_empty(3, 4, 2, 8, dtype=torch.float16) for _ in range(4)]), TypeError,
         r"src_caches\[0\] is torch.float32 but dst_caches\[0\] is torch.float16"),
        ("swap-count", s(m, dst=host[:3]), ValueError, "src_caches has 4 tensors but dst_caches has 3"),
        ("swap-dst-out-of-range", s(torch.tensor([[0, 3]])), ValueError, r"destination block id 3, outside \[0, 3\)"),
        ("swap-src-out-of-range", s(torch.tensor([[6, 0]])), ValueError, r"source block id 6, outside \[0, 6\)"),
        ("swap-duplicate-dst", s(torch.tensor([[0, 2], [1, 2]])), ValueError, "destination block 2 more than once"),
        ("swap-stream-on-cpu", s(m, stream=0), ValueError, "stream must be None"),
        ("swap-inside-one-pool", lambda: ops.swap_blocks(kc, kc, torch.tensor([[0, 1], [1, 2]])), ValueError,
         "both a source and a destination"),
        ("host-pool-num-blocks", lambda: ops.HostPool(kc, 0), ValueError, "num_blocks must be positive"),
        ("host-pool-num-blocks-type", lambda: ops.HostPool(kc, 2.0), TypeError, "num_blocks must be an int"),
        ("host-pool-like", lambda: ops.HostPool(kc[0], 2), TypeError, "like must be a list"),

    ]


BAD = _bad_cases()


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["packed", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("method", ["auto", "batch", "kernel", "memcpy"])
def test_swap_round_trip_gpu_is_bit_exact(method, dtype, interleaved):
    if method == "batch" and _C.cuda_batch_memcpy_error():
        pytest.skip(f"cuMemcpyBatchAsync unavailable: {_C.cuda_batch_memcpy_error()}")
    stream = torch.cuda.Stream()  # the batch API refuses the legacy default stream
    host = _round_trip("cuda", dtype, interleaved, device="cuda", cuda_method=method, stream=stream)
    assert host.pinned


@pytest.mark.gpu
def test_failed_batch_swap_names_the_cuda_result():
    """cuMemcpyBatchAsync refuses the legacy default stream (handle 0, CUDA's documentation of
    the call): the error names the CUresult, its number, and the copy when the driver names one."""
    if _C.cuda_batch_memcpy_error():
        pytest.skip(f"cuMemcpyBatchAsync unavailable: {_C.cuda_batch_memcpy_error()}")
    k_caches, _ = make_pool(2, 8, 16, 2, 32, torch.float16, interleaved=False, device="cuda")
    host = ops.HostPool(k_caches, 4)
    torch.cuda.synchronize()
    words = (r"cuMemcpyBatchAsync failed: CUDA_ERROR_[A-Z_]+ \(\d+\)"
             r"( at copy \d+ of \d+ \(\d+ bytes\)| \(the driver names no single copy\))")
    with pytest.raises(RuntimeError, match=words):
        _swap_blocks(k_caches, host.caches, torch.tensor([[5, 0], [1, 3]]), stream=0, backend=None,
                     cuda_method="batch")


@pytest.mark.gpu
def test_swap_gpu_stream_handle_and_pageable_fallback():
    k_caches, _ = make_pool(2, 8, 16, 2, 32, torch.float16, interleaved=False, device="cuda")
    pageable = [nan_empty(4, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
    mapping = torch.tensor([[5, 0], [1, 3]])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    ops.swap_blocks(k_caches, pageable, mapping, stream=stream.cuda_stream)
    stream.synchronize()
    for src, dst in zip(k_caches, pageable):
        assert same_bits(dst[0], src[5].cpu()) and same_bits(dst[3], src[1].cpu())


@pytest.mark.gpu
def test_host_pool_pins_its_buffer_and_the_kernel_can_map_it():
    like = [torch.empty(10, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    pool = ops.HostPool(like, 300)  # 300 x 3 x 32 KiB: not a power of two
    assert pool.pinned and all(t.is_pinned() for t in pool.caches)
    assert all(_C.cuda_host_device_pointer(t[7].data_ptr()) != 0 for t in pool.caches)
