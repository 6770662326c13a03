"""The KV cache ops in one namespace, for `from cb_kernels.ops.cache_ops import ...`: each op
lives in its own module (ops/write_kv.py, ops/copy_blocks.py, ops/swap_blocks.py)."""
from cb_kernels.ops.copy_blocks import copy_blocks
from cb_kernels.ops.swap_blocks import _swap_blocks, swap_blocks
from cb_kernels.ops.write_kv import run_write_kv, write_kv, write_kv_unchecked

__all__ = ["write_kv", "write_kv_unchecked", "copy_blocks", "swap_blocks"]
