"""Cache pools and byte comparisons shared by test_write_kv.py, test_copy_blocks.py and
test_swap_blocks.py. Pools start filled with NaN so a kernel that reads or keeps unwritten memory
fails loudly; results are compared as raw bytes (NaN != NaN under torch.equal)."""
import torch

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

