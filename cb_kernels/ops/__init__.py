"""Public kernel API (see DESIGN.md, "Kernel API"). Each op: validation, backend choice, and a
torch.library custom op; `reference.py` holds the pure-torch oracle of every op."""
from cb_kernels.ops._backend import available_backends
from cb_kernels.ops.cache_ops import copy_blocks, swap_blocks, write_kv
from cb_kernels.ops.greedy_head import GreedyHead
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.host_pool import HostPool
from cb_kernels.ops.paged_attention import paged_attention
from cb_kernels.ops.sampling import greedy_tokens

__all__ = ["available_backends", "paged_attention", "write_kv", "copy_blocks", "swap_blocks",
           "HostPool", "greedy_tokens", "GreedyHead", "PackedLinear"]
