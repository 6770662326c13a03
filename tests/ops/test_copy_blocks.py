"""copy_blocks: every backend against ops/reference.py's ref_copy_blocks, bit for bit, every
dtype and both pool layouts; the registered op; every bad input names its argument."""
import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_copy_blocks
from kv_pools import DTYPE_IDS, DTYPES, make_pool, same_bits


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


def test_registered_op_matches_reference_and_passes_opcheck():
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=True)
    mapping = torch.tensor([[0, 1], [2, 5]])
    k_ref, v_ref = [t.clone() for t in k_caches], [t.clone() for t in v_caches]
    ref_copy_blocks(k_ref, v_ref, mapping)
    torch.ops.cb_kernels.copy_blocks(k_caches, v_caches, mapping, "cpu")
    assert all(same_bits(a, b) for a, b in zip(k_caches + v_caches, k_ref + v_ref))
    torch.library.opcheck(torch.ops.cb_kernels.copy_blocks.default, (k_caches, v_caches, mapping, "cpu"))


def _bad_cases():
    kc, vc = make_pool(2, 6, 4, 2, 8, torch.float32, interleaved=False)
    m = torch.tensor([[0, 1]])
    c = lambda mapping, **kw: lambda: ops.copy_blocks(kw.get("k", kc), kw.get("v", vc), mapping)  # noqa: E731
    return [
        ("copy-duplicate-dst", c(torch.tensor([[0, 1], [2, 1]])), ValueError, "destination block 1 more than once"),
        ("copy-dst-out-of-range", c(torch.tensor([[0, 6]])), ValueError, "destination block id 6"),
        ("copy-src-negative", c(torch.tensor([[-1, 2]])), ValueError, "source block id -1"),
        ("copy-src-is-dst", c(torch.tensor([[0, 1], [1, 2]])), ValueError, "both a source and a destination"),
        ("copy-mapping-int32", c(m.int()), TypeError, "block_mapping must be int64"),
        ("copy-mapping-shape", c(torch.tensor([0, 1])), ValueError, r"block_mapping must be \[n, 2\]"),
        ("copy-mapping-strided", c(torch.tensor([[0, 9, 1, 9]])[:, ::2]), ValueError,
         "block_mapping must be contiguous"),
        ("copy-layers-mismatch", c(m, v=vc[:1]), ValueError, "k_caches has 2 tensors but v_caches has 1"),
        ("copy-dtype-mismatch", c(m, v=[t.half() for t in vc]), TypeError, r"k_caches\[0\] is torch.float32"),
        ("copy-not-a-list", c(m, k=kc[0]), TypeError, "k_caches must be a list"),
        ("copy-empty-list", c(m, k=[], v=[]), ValueError, "k_caches must not be empty"),
        ("copy-block-count", c(m, k=[kc[0], kc[1][:5]]), ValueError, r"k_caches\[1\] has 5 blocks"),
        ("copy-block-not-packed", c(m, k=[t.transpose(1, 2) for t in kc]), ValueError, "packed inside each block"),
        ("copy-backend", lambda: ops.copy_blocks(kc, vc, m, backend="triton"), ValueError, "no 'triton' backend"),
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
def test_registered_op_passes_opcheck_on_cuda():
    k_caches, v_caches = make_pool(2, 6, 4, 2, 8, torch.float16, interleaved=True, device="cuda")
    torch.library.opcheck(torch.ops.cb_kernels.copy_blocks.default,
                          (k_caches, v_caches, torch.tensor([[0, 1], [2, 5]]), "cuda"))
