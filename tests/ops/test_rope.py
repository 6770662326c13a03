"""rope_ (csrc/cpu/elementwise.cpp) against ops/reference.py's ref_rope_ (transformers'
apply_rotary_pos_emb formula), in place on strided views, the registered op, and the bad inputs."""
import pytest
import torch

from cb_kernels import ops
from cb_kernels.ops.reference import ref_rope_


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(num_tokens, num_heads, head_dim):
    qkv = _r(num_tokens, num_heads * head_dim + 5)
    x = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided, as the engine's
    return x, _r(num_tokens, head_dim, seed=1), _r(num_tokens, head_dim, seed=2)


@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(16, 9, 64), (1, 2, 32), (7, 3, 18)])
def test_matches_reference_in_place(num_tokens, num_heads, head_dim):
    x, cos, sin = _inputs(num_tokens, num_heads, head_dim)
    want = ref_rope_(x.clone(), cos, sin)
    out = ops.rope_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


def test_reference_rotates_a_pair_by_hand():
    x = torch.tensor([[[1.0, 2.0]]])                  # one token, one head, head_dim 2
    c, s = 0.6, 0.8
    cos, sin = torch.full((1, 2), c), torch.full((1, 2), s)
    torch.testing.assert_close(ref_rope_(x, cos, sin), torch.tensor([[[1 * c - 2 * s, 2 * c + 1 * s]]]))


def test_registered_op_matches_reference_and_passes_opcheck():
    x, cos, sin = _inputs(7, 3, 18)
    want = ref_rope_(x.clone(), cos, sin)
    torch.ops.cb_kernels.rope_(x, cos, sin)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.cb_kernels.rope_.default, _inputs(7, 3, 18))


def test_traces_under_torch_compile():
    x, cos, sin = _inputs(5, 4, 16)
    want = ref_rope_(x.clone(), cos, sin)
    compiled = torch.compile(lambda a, b, c: ops.rope_(a, b, c) * 1.0, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ops.rope_(_r(3, 2, 7), _r(3, 7), _r(3, 7)), ValueError, "even head_dim"),
    (lambda: ops.rope_(_r(3, 2, 8), _r(4, 8), _r(3, 8)), ValueError, "cos must be contiguous"),
    (lambda: ops.rope_(_r(3, 2, 8), _r(3, 8), _r(3, 8).double()), TypeError, "sin must be a float32 or bfloat16 CPU"),
    (lambda: ops.rope_(_r(3, 16), _r(3, 16), _r(3, 16)), ValueError, "x must be"),
], ids=["odd-dim", "cos-shape", "sin-dtype", "x-2d"])
def test_bad_input_raises_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()
