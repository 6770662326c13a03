"""write_kv, copy_blocks, swap_blocks and HostPool: every backend against ops/reference.py, bit for
bit. Pools start filled with NaN so a kernel that reads or keeps unwritten memory fails loudly;
results are compared as raw bytes (NaN != NaN under torch.equal)."""
import logging

import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops import cache_ops
from cb_kernels.ops.reference import ref_copy_blocks, ref_swap_blocks, ref_write_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
DTYPE_IDS = ["fp32", "fp16", "bf16", "fp8"]


def nan_empty(*shape, dtype=torch.float32, device="cpu"):
    return torch.empty(*shape, dtype=dtype, device=device).fill_(float("nan"))


def random_like_dtype(*shape, dtype, device="cpu", gen=None):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def same_bits(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def make_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, *, interleaved, device="cpu",
              fill="random", seed=0):
    """k_caches, v_caches: lists over layers of [num_blocks, block_size, num_kv_heads, head_dim].

    interleaved=True builds them as strided views of one [num_blocks, num_layers, 2, block_size, ...]
    tensor, the layout of transformers' paged cache (layers and K/V inside each block).
    """
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim) if interleaved else \
        (2 * num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    whole = nan_empty(*shape, dtype=dtype, device=device)
    if fill == "random":
        whole.copy_(random_like_dtype(*shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(seed)))
    if interleaved:
        return [whole[:, i, 0] for i in range(num_layers)], [whole[:, i, 1] for i in range(num_layers)]
    return list(whole[:num_layers]), list(whole[num_layers:])


# ---------------------------------------------------------------- write_kv
WRITE_CASES = [  # (id, num_tokens, num_kv_heads, head_dim, block_size, strided)
    ("decode-4", 4, 2, 64, 16, False),
    ("prefill-63-awkward", 63, 3, 60, 16, False),
    ("strided-views", 17, 2, 32, 8, True),
    ("one-head-d8", 5, 1, 8, 4, True),
]


def _write_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype, strided, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    k_caches, v_caches = make_pool(1, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                   interleaved=strided, fill="nan", device=device)
    if strided:  # key/value as slices of a fused qkv-like tensor: token stride > heads * head_dim
        fused = random_like_dtype(num_tokens, 2, num_kv_heads, head_dim + 4, dtype=dtype, gen=g).to(device)
        key, value = fused[:, 0, :, :head_dim], fused[:, 1, :, 4:]
    else:
        key = random_like_dtype(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=g).to(device)
        value = random_like_dtype(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    slots[0] = -1
    return key, value, k_caches[0], v_caches[0], slots.to(device)


def _check_write_kv(backend, case, dtype, device="cpu"):
    _, num_tokens, num_kv_heads, head_dim, block_size, strided = case
    key, value, k_cache, v_cache, slots = _write_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype,
                                                        strided, device)
    assert k_cache.is_contiguous() != strided and key.is_contiguous() != strided
    k_ref, v_ref = k_cache.cpu().clone(), v_cache.cpu().clone()
    ref_write_kv(key.cpu(), value.cpu(), k_ref, v_ref, slots.cpu())
    ops.write_kv(key, value, k_cache, v_cache, slots, backend=backend)
    assert same_bits(k_cache.cpu(), k_ref) and same_bits(v_cache.cpu(), v_ref)
    # The reference itself wrote the kept tokens and nothing else.
    kept = slots.cpu() >= 0
    assert int(torch.isnan(k_ref.float()).logical_not().sum()) == int(kept.sum()) * num_kv_heads * head_dim


@pytest.mark.parametrize("case", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cpu", "torch", None])
def test_write_kv_matches_reference(backend, case, dtype):
    _check_write_kv(backend, case, dtype)


@pytest.mark.parametrize("case", WRITE_CASES[1:3], ids=[c[0] for c in WRITE_CASES[1:3]])
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=DTYPE_IDS[:3])
def test_write_kv_triton_matches_reference(case, dtype):
    _check_write_kv("triton", case, dtype)


def test_write_kv_all_skipped_and_empty_leave_cache_untouched():
    key, value, k_cache, v_cache, _ = _write_inputs(6, 2, 16, 4, torch.float32, False)
    before = k_cache.clone()
    ops.write_kv(key, value, k_cache, v_cache, torch.full((6,), -1, dtype=torch.int64))
    ops.write_kv(key[:0], value[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert same_bits(k_cache, before)


# ---------------------------------------------------------------- copy_blocks
@pytest.mark.parametrize("interleaved", [False, True], ids=["packed", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cpu", "torch", None])
def test_copy_blocks_matches_reference(backend, dtype, interleaved):
    k_caches, v_caches = make_pool(3, 13, 16, 2, 24, dtype, interleaved=interleaved)
    mapping = torch.tensor([[9, 2], [0, 11], [4, 7], [12, 5]])
    k_ref, v_ref = [t.clone() for t in k_caches], [t.clone() for t in v_caches]
    ref_copy_blocks(k_ref, v_ref, mapping)
    ops.copy_blocks(k_caches, v_caches, mapping, backend=backend)
    for got, want in zip(k_caches + v_caches, k_ref + v_ref):
        assert same_bits(got, want)
    assert same_bits(k_caches[1][11], k_caches[1][0]) and same_bits(v_caches[2][5], v_caches[2][12])


# ---------------------------------------------------------------- swap_blocks + HostPool
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
        cache_ops._swap_blocks(src, dst, m, stream=stream, backend=backend, cuda_method=cuda_method)
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


# ---------------------------------------------------------------- torch.library
def test_custom_ops_pass_opcheck():
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch.library.opcheck(torch.ops.cb_kernels.write_kv.default,
                          (key, value, k_caches[0], v_caches[0], torch.tensor([0, -1, 9]), "cpu"))
    torch.library.opcheck(torch.ops.cb_kernels.copy_blocks.default,
                          (k_caches, v_caches, torch.tensor([[0, 1], [2, 5]]), "cpu"))


# ---------------------------------------------------------------- bad input
def _bad_cases():
    kc, vc = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    key, value, slots = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 5, -1])
    m = torch.tensor([[0, 1]])
    host = [nan_empty(3, 4, 2, 8) for _ in range(4)]
    w = lambda **kw: lambda: ops.write_kv(**{**dict(key=key, value=value, k_cache=kc[0], v_cache=vc[0],  # noqa: E731
                                                    slot_mapping=slots), **kw})
    c = lambda mapping, **kw: lambda: ops.copy_blocks(kw.get("k", kc), kw.get("v", vc), mapping)  # noqa: E731
    s = lambda mapping, dst=host, **kw: lambda: ops.swap_blocks(kc + vc, dst, mapping, **kw)  # noqa: E731
    return [
        ("slot-beyond-pool", w(slot_mapping=torch.tensor([0, 24, -1])), ValueError, "slot_mapping.*24"),
        ("slot-below-minus-one", w(slot_mapping=torch.tensor([0, -2, 1])), ValueError, "slot_mapping.*-2"),
        ("slot-written-twice", w(slot_mapping=torch.tensor([3, 3, -1])), ValueError, "slot_mapping.*twice"),
        ("slot-int32", w(slot_mapping=slots.int()), TypeError, "slot_mapping must be int64"),
        ("slot-length", w(slot_mapping=slots[:2]), ValueError, "slot_mapping has 2"),
        ("key-dtype", w(key=key.half()), TypeError, "key"),
        ("key-heads", w(key=torch.randn(3, 3, 8), value=torch.randn(3, 3, 8)), ValueError, "num_kv_heads"),
        ("key-not-packed", w(key=torch.randn(3, 2, 16)[:, :, ::2]), ValueError, "key must be contiguous along"),
        ("value-shape", w(value=torch.randn(4, 2, 8)), ValueError, "value has shape"),
        ("v-cache-shape", w(v_cache=torch.randn(7, 4, 2, 8)), ValueError, "v_cache has shape"),
        ("key-not-tensor", w(key=[1, 2]), TypeError, "key must be a torch.Tensor"),
        ("write-backend", w(backend="metal"), ValueError, "backend must be one of"),
        ("copy-duplicate-dst", c(torch.tensor([[0, 1], [2, 1]])), ValueError, "destination block 1 more than once"),
        ("copy-dst-out-of-range", c(torch.tensor([[0, 6]])), ValueError, "destination block id 6"),
        ("copy-src-negative", c(torch.tensor([[-1, 2]])), ValueError, "source block id -1"),
        ("copy-src-is-dst", c(torch.tensor([[0, 1], [1, 2]])), ValueError, "both a source and a destination"),
        ("copy-mapping-int32", c(m.int()), TypeError, "block_mapping must be int64"),
        ("copy-mapping-shape", c(torch.tensor([0, 1])), ValueError, r"block_mapping must be \[n, 2\]"),
        ("copy-mapping-strided", c(torch.tensor([[0, 9, 1, 9]])[:, ::2]), ValueError, "block_mapping must be contiguous"),
        ("copy-layers-mismatch", c(m, v=vc[:1]), ValueError, "k_caches has 2 tensors but v_caches has 1"),
        ("copy-dtype-mismatch", c(m, v=[t.half() for t in vc]), TypeError, r"k_caches\[0\] is torch.float32"),
        ("copy-not-a-list", c(m, k=kc[0]), TypeError, "k_caches must be a list"),
        ("copy-empty-list", c(m, k=[], v=[]), ValueError, "k_caches must not be empty"),
        ("copy-block-count", c(m, k=[kc[0], kc[1][:5]]), ValueError, r"k_caches\[1\] has 5 blocks"),
        ("copy-block-not-packed", c(m, k=[t.transpose(1, 2) for t in kc]), ValueError, "packed inside each block"),
        ("copy-backend", lambda: ops.copy_blocks(kc, vc, m, backend="triton"), ValueError, "no 'triton' backend"),
        ("swap-geometry", s(m, dst=[nan_empty(3, 4, 2, 4) for _ in range(4)]), ValueError, r"blocks of shape"),
        ("swap-dtype", s(m, dst=[nan_empty(3, 4, 2, 8, dtype=torch.float16) for _ in range(4)]), TypeError, "dst_caches"),
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


def test_mapping_on_device_is_rejected_before_any_copy():
    meta = torch.tensor([[0, 1]], device="meta")
    kc, vc = make_pool(1, 4, 4, 1, 8, torch.float32, interleaved=False)
    with pytest.raises(ValueError, match="block_mapping must be a CPU tensor"):
        ops.copy_blocks(kc, vc, meta)


# ---------------------------------------------------------------- CUDA paths
@pytest.mark.gpu
@pytest.mark.parametrize("case", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_write_kv_gpu_matches_reference(backend, case, dtype):
    if backend == "triton" and dtype == torch.float8_e4m3fn:
        pytest.skip("the triton write_kv takes fp32/fp16/bf16")
    _check_write_kv(backend, case, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["packed", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_copy_blocks_gpu_matches_reference(dtype, interleaved):
    k_caches, v_caches = make_pool(3, 13, 16, 2, 24, dtype, interleaved=interleaved, device="cuda")
    mapping = torch.tensor([[9, 2], [0, 11], [4, 7], [12, 5]])
    k_ref, v_ref = [t.clone() for t in k_caches], [t.clone() for t in v_caches]
    ref_copy_blocks(k_ref, v_ref, mapping)
    ops.copy_blocks(k_caches, v_caches, mapping, backend="cuda")
    for got, want in zip(k_caches + v_caches, k_ref + v_ref):
        assert same_bits(got, want)


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
def test_write_kv_cuda_graph_replays_with_new_slots():
    key, value, k_cache, v_cache, slots = _write_inputs(8, 2, 64, 16, torch.bfloat16, False, "cuda")
    static_slots = slots.clone()
    ops.write_kv(key, value, k_cache, v_cache, static_slots, backend="cuda")  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.write_kv(key, value, k_cache, v_cache, static_slots, backend="cuda")
    static_slots.copy_(torch.randperm(k_cache.shape[0] * k_cache.shape[1], device="cuda")[:8])
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    k_ref, v_ref = nan_empty(*k_cache.shape, dtype=k_cache.dtype), nan_empty(*v_cache.shape, dtype=v_cache.dtype)
    ref_write_kv(key.cpu(), value.cpu(), k_ref, v_ref, static_slots.cpu())
    assert same_bits(k_cache.cpu(), k_ref) and same_bits(v_cache.cpu(), v_ref)


@pytest.mark.gpu
def test_custom_ops_pass_opcheck_on_cuda():
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float16, interleaved=True, device="cuda")
    key, value = torch.randn(3, 2, 8, device="cuda").half(), torch.randn(3, 2, 8, device="cuda").half()
    slots = torch.tensor([0, -1, 9], device="cuda")
    torch.library.opcheck(torch.ops.cb_kernels.write_kv.default, (key, value, k_caches[0], v_caches[0], slots, "cuda"))
    torch.library.opcheck(torch.ops.cb_kernels.copy_blocks.default,
                          (k_caches, v_caches, torch.tensor([[0, 1], [2, 5]]), "cuda"))
