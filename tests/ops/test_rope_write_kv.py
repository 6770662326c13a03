"""`rope_write_kv_`: one pass that equals `rope_(q)`, `rope_(k)` and `write_kv(k, v, ...)` bit for
bit (every ISA body this CPU runs, fp32 and bf16, q/k/v as views into a fused qkv output, caches
of any block layout), and the reference formula; bad arguments raise naming the argument."""
import pytest
import torch

from cb_kernels import _C, ops
from cb_kernels.ops.reference import ref_rope_write_kv_

ISAS = [isa for isa in _C.cpu_isas() if isa in ("portable", "avx2", "avx512_bf16")]
DTYPES = [torch.float32, torch.bfloat16]


def _case(dtype, num_tokens=16, num_heads=9, num_kv_heads=3, head_dim=64, num_blocks=12,
          block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 6
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1                               # a skipped token
    return qkv, q, k, v, cos, sin, k_cache, v_cache, slots


def _separate(q, k, v, cos, sin, k_cache, v_cache, slots, isa):
    ops.rope_(q, cos, sin, isa=isa)
    ops.rope_(k, cos, sin, isa=isa)
    ops.write_kv(k, v, k_cache, v_cache, slots, backend="cpu")


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim",
                         [(16, 9, 3, 64), (1, 4, 4, 8), (37, 8, 2, 18), (300, 4, 2, 64)])
def test_equals_rope_rope_write_kv(isa, dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    a = _case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, num_blocks=80, block_size=4)
    b = [t.clone() for t in a]
    # b's q/k/v must stay views of b's qkv: rebuild them from the cloned qkv
    qkv_b = b[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qb, kb, vb = qkv_b.split([q_size, kv_size, kv_size], dim=-1)
    b[1:4] = [qb.view(num_tokens, num_heads, head_dim), kb.view(num_tokens, num_kv_heads, head_dim),
              vb.view(num_tokens, num_kv_heads, head_dim)]
    ops.rope_write_kv_(*a[1:], isa=isa)
    _separate(*b[1:], isa=isa)
    for got, want in zip(a, b):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_matches_reference_and_skips_slot_minus_one(dtype):
    qkv, q, k, v, cos, sin, k_cache, v_cache, slots = _case(dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    ref = [t.clone() for t in (q, k, v, cos, sin, k_cache, v_cache, slots)]
    ops.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_rope_write_kv_(*ref)
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, ref[0], **tol)
    torch.testing.assert_close(k_cache, ref[5], **tol)
    torch.testing.assert_close(v_cache, ref[6], **tol)
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_k, flat_k0 = k_cache.view(-1, *k_cache.shape[2:]), k0.view(-1, *k0.shape[2:])
    assert torch.equal(flat_k[~written], flat_k0[~written])
    assert torch.equal(v_cache.view(-1, *v_cache.shape[2:])[~written],
                       v0.view(-1, *v0.shape[2:])[~written])
    assert torch.equal(v_cache.view(-1, *v_cache.shape[2:])[slots[0]], v[0])


def test_unchecked_is_the_same_pass():
    a = _case(torch.bfloat16, seed=3)
    b = _case(torch.bfloat16, seed=3)
    ops.rope_write_kv_(*a[1:])
    ops.rope_write_kv_unchecked(*b[1:])
    for got, want in zip(a, b):
        assert torch.equal(_bits(got), _bits(want))


def test_bad_arguments_name_the_argument():
    qkv, q, k, v, cos, sin, k_cache, v_cache, slots = _case(torch.float32)
    with pytest.raises(TypeError, match="k must be a tensor of q's dtype"):
        ops.rope_write_kv_(q, k.bfloat16(), v, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos must be contiguous"):
        ops.rope_write_kv_(q, k, v, cos[:-1], sin, k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="v_cache must be a tensor of q's dtype"):
        ops.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="num_kv_heads and head_dim must match"):
        ops.rope_write_kv_(q, k, v, cos, sin, k_cache[:, :, :2].contiguous(),
                           v_cache[:, :, :2].contiguous(), slots)
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        ops.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slots.int())
    bad = slots.clone()
    bad[0] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(ValueError):
        ops.rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, bad)
    with pytest.raises(ValueError, match="with q's tokens and head_dim"):
        ops.rope_write_kv_(q[:-1], k, v, cos[:-1], sin[:-1], k_cache, v_cache, slots)
