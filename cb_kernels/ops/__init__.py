"""Public kernel API (see DESIGN.md, "Kernel API"). Each op: validation, backend choice, and a
torch.library custom op; `reference.py` holds the pure-torch oracle of every op.

The `*_unchecked` variants are the engine's hot path: the same kernels without the per-call
checks, for arguments the caller has checked once (their docstrings say what is still checked).
"""
from cb_kernels.ops._backend import available_backends
from cb_kernels.ops.causal_conv1d import causal_conv1d, causal_conv1d_unchecked
from cb_kernels.ops.copy_blocks import copy_blocks
from cb_kernels.ops.fused_decoder import FusedDecoder
from cb_kernels.ops.fused_hybrid import gated_delta_net, mamba2_mixer
from cb_kernels.ops.gated_attention import gated_attention_block
from cb_kernels.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_unchecked
from cb_kernels.ops.gated_rms_norm import gated_rms_norm
from cb_kernels.ops.greedy_head import GreedyHead
from cb_kernels.ops.greedy_tokens import greedy_tokens
from cb_kernels.ops.host_pool import HostPool
from cb_kernels.ops.linear import PackedLinear
from cb_kernels.ops.mamba2_stack import Mamba2Stack, Mamba2StackLayer
from cb_kernels.ops.moe import PackedExperts, moe_experts, moe_route
from cb_kernels.ops.moe_block import moe_block
from cb_kernels.ops.offset_rms_norm import offset_rms_norm
from cb_kernels.ops.paged_attention import paged_attention, paged_attention_unchecked
from cb_kernels.ops.qwen3_next_stack import (Qwen3NextAttentionLayer, Qwen3NextDeltaNetLayer,
                                             Qwen3NextMlp, Qwen3NextStack)
from cb_kernels.ops.rms_norm import rms_norm, rms_norm_unchecked
from cb_kernels.ops.rope import rope_
from cb_kernels.ops.rope_write_kv import rope_write_kv_, rope_write_kv_unchecked
from cb_kernels.ops.sample_tokens import sample_tokens
from cb_kernels.ops.selective_scan import selective_scan
from cb_kernels.ops.silu_mul import silu_mul
from cb_kernels.ops.swap_blocks import swap_blocks
from cb_kernels.ops.write_kv import write_kv, write_kv_unchecked

__all__ = ["available_backends", "paged_attention", "paged_attention_unchecked", "write_kv",
           "write_kv_unchecked", "copy_blocks", "swap_blocks", "HostPool", "greedy_tokens",
           "GreedyHead", "PackedLinear", "rms_norm", "rms_norm_unchecked", "silu_mul", "rope_",
           "rope_write_kv_", "rope_write_kv_unchecked", "FusedDecoder", "gated_delta_rule",
           "gated_delta_rule_unchecked", "causal_conv1d", "causal_conv1d_unchecked", "selective_scan",
           "PackedExperts", "moe_experts", "gated_rms_norm", "sample_tokens",
           "offset_rms_norm", "moe_route", "moe_block", "gated_delta_net", "mamba2_mixer",
           "gated_attention_block", "Mamba2Stack", "Mamba2StackLayer", "Qwen3NextStack",
           "Qwen3NextDeltaNetLayer", "Qwen3NextAttentionLayer", "Qwen3NextMlp"]
