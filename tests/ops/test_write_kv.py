"""write_kv: every backend against ops/reference.py's ref_write_kv, bit for bit, every dtype;
the slot checks on both paths; the registered op; every bad input names its argument."""
import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_write_kv
from cb_kernels.ops.write_kv import run_write_kv
from kv_pools import DTYPE_IDS, DTYPES, make_pool, nan_empty, random_like_dtype, same_bits

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


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_write_kv_kernels_skip_slots_past_the_pool_when_unchecked(backend):
    """Inside a CUDA graph the wrapper cannot check slot values; the kernels must still never write
    out of bounds."""
    key, value, k_cache, v_cache, _ = _write_inputs(3, 2, 16, 4, torch.float32, False)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    run_write_kv(backend, key, value, k_cache, v_cache, torch.tensor([num_slots, 10**9, 1]))
    assert same_bits(k_cache[0, 1], key[2]) and same_bits(v_cache[0, 1], value[2])
    assert int(torch.isnan(k_cache).logical_not().sum()) == key[2].numel()


def test_registered_op_matches_reference_and_passes_opcheck():
    key, value, k_cache, v_cache, slots = _write_inputs(17, 2, 32, 8, torch.float32, True)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref_write_kv(key, value, k_ref, v_ref, slots)
    torch.ops.cb_kernels.write_kv(key, value, k_cache, v_cache, slots, "cpu")
    assert same_bits(k_cache, k_ref) and same_bits(v_cache, v_ref)
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch.library.opcheck(torch.ops.cb_kernels.write_kv.default,
                          (key, value, k_caches[0], v_caches[0], torch.tensor([0, -1, 9]), "cpu"))


def _bad_cases():
    kc, vc = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    key, value, slots = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.tensor([0, 5, -1])
    w = lambda **kw: lambda: ops.write_kv(**{**dict(key=key, value=value, k_cache=kc[0], v_cache=vc[0],  # noqa: E731
                                                    slot_mapping=slots), **kw})
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
    ]


BAD = _bad_cases()


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("num_tokens", [5, 300], ids=["list-check", "torch-check"])
def test_bad_slots_are_caught_on_both_check_paths(num_tokens):
    key, value, k_cache, v_cache, _ = _write_inputs(num_tokens, 1, 8, 16, torch.float32, False)
    slots = torch.arange(num_tokens)
    slots[-1] = slots[0]
    with pytest.raises(ValueError, match="slot_mapping writes one slot twice"):
        ops.write_kv(key, value, k_cache, v_cache, slots)
    slots[-1] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(ValueError, match=f"slot_mapping has slot {int(slots[-1])}, outside"):
        ops.write_kv(key, value, k_cache, v_cache, slots)
    slots[-1] = -1
    ops.write_kv(key, value, k_cache, v_cache, slots)
    assert same_bits(k_cache.view(-1, 1, 8)[:num_tokens - 1], key[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_write_kv_gpu_matches_reference(backend, case, dtype):
    if backend == "triton" and dtype == torch.float8_e4m3fn:
        pytest.skip("the triton write_kv takes fp32/fp16/bf16")
    _check_write_kv(backend, case, dtype, device="cuda")


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
def test_registered_op_passes_opcheck_on_cuda():
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float16, interleaved=True, device="cuda")
    key, value = torch.randn(3, 2, 8, device="cuda").half(), torch.randn(3, 2, 8, device="cuda").half()
    slots = torch.tensor([0, -1, 9], device="cuda")
    torch.library.opcheck(torch.ops.cb_kernels.write_kv.default, (key, value, k_caches[0], v_caches[0], slots, "cuda"))
