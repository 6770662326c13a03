"""`greedy_tokens` for `from cb_kernels.ops.sampling import greedy_tokens`; the op lives in
ops/greedy_tokens.py."""
from cb_kernels.ops.greedy_tokens import greedy_tokens

__all__ = ["greedy_tokens"]
