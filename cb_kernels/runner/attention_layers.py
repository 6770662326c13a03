"""Each attention layer's plan (`layer_plans`): what it needs from the KV cache and the kernel,
read off one probe forward (runner/probe.py), and everything about its calls the engine cannot
reproduce refused with UnsupportedModelError.

A layer's mask is classified by evaluating its mask function (full causal, a sliding window of W
keys, chunks of C tokens, or anything else, runner/masks.py); that, not a config field, is what
transformers' own sdpa/eager path applies, so phimoe's window (no `layer_types`) is found as well
as Gemma's. `check_positions` refuses a model whose positions do not come from position_ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.runner.attention import text_config
from cb_kernels.runner.masks import mask_pattern, tensor_is_causal
from cb_kernels.runner.probe import record_calls
from cb_kernels.runner.support import STATELESS_LAYER_TYPES, UnsupportedModelError, static_check


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer (one layer_idx) needs from the KV cache and the kernel.

    num_kv_heads, head_dim: K's shape per token; v_head_dim: V's head size (latent attention:
    smaller than K's, stored padded to head_dim). window: keys per query (sliding window) or
    None. chunk: chunked attention (a query attends to its own chunk of `chunk` positions, up to
    itself) or None. sinks: the layer passes a learned per-head sink logit (`s_aux`).
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: Optional[int] = None
    chunk: Optional[int] = None
    sinks: bool = False


# The keyword arguments the attention call may receive that change nothing here (positions,
# rotary tables, flash/paged-only metadata, the engine's own step) or that our function applies
# itself (sliding_window is read from the mask, softcap and scaling from the call).
_KNOWN_KWARGS = frozenset({
    "cbk_step", "position_ids", "position_embeddings", "cache_position", "output_attentions",
    "use_cache", "sliding_window", "softcap", "scaling", "dropout", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal", "s_aux", "head_mask",
    "layer_head_mask", "past_key_values", "cache", "layer_idx", "output_hidden_states",
    "return_dict", "attention_type", "output_router_logits",
    "logits_to_keep",
})
_PROBE_TOKENS = 6


def check_positions(model, configs, num_tokens: int, state_layers=None) -> None:
    """Refuses a model whose positions do not come from position_ids (the engine's only way to
    tell a layer where its tokens are; e.g. BART-style decoders count them from the cache).

    Two probe forwards of one repeated token at positions 0.. and 7..: a layer whose queries are
    the same in both runs ignores position_ids; if its queries still differ from row to row, the
    positions came from somewhere else. (A layer without positions at all, NoPE, has equal rows:
    the probe's attention returns zeros, so no position reaches it through earlier layers.)"""
    if state_layers:
        # A stateful layer mixes earlier tokens into every row, so a layer without positions
        # (NoPE: Jamba's, Nemotron-H's attention) has rows that differ as well: this probe cannot
        # tell it from one that counts positions itself. These families are checked against
        # generate() by their tests instead.
        return
    device = next(model.parameters()).device
    ids = torch.full((1, num_tokens), 3 % model.get_input_embeddings().num_embeddings,
                     device=device)
    a = record_calls(model, configs, num_tokens, ids, offset=0, state_layers=state_layers).calls
    b = record_calls(model, configs, num_tokens, ids, offset=7, state_layers=state_layers).calls
    for ca, cb in zip(a, b):
        same_across = torch.equal(ca.query, cb.query)
        rows_differ = not torch.equal(ca.query, ca.query[:, :1].expand_as(ca.query))
        if same_across and rows_differ:
            raise UnsupportedModelError(
                f"{type(model).__name__}: layer {ca.layer_idx}'s positions do not come from "
                "position_ids (the model counts them itself, e.g. from its cache), so "
                "cb_kernels cannot tell it where a step's tokens are")


def _cache_windows(cfg, num_layers: int) -> list:
    """Per layer, the window transformers' DynamicCache keeps for this config (what generate()
    decodes with), or None."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=cfg)
    except Exception:                         # noqa: BLE001 (an older or custom cache)
        return []
    sliding = getattr(cache, "is_sliding", None) or []
    layers = getattr(cache, "layers", None) or []
    return [getattr(layer, "sliding_window", None) if is_sliding else None
            for is_sliding, layer in zip(sliding, layers)][:num_layers]


def layer_plans(model, configs, num_layers: int, state_layers: Optional[dict] = None) -> list:
    """Per layer_idx, its LayerAttention, or None for a layer without attention (a stateful one
    of `state_layers`, or a bare MLP / MoE block); raises UnsupportedModelError for anything the
    engine cannot run exactly."""
    state_layers = state_layers or {}
    static_check(model, state_layers)
    name = type(model).__name__
    cfg = text_config(model)
    max_positions = getattr(cfg, "max_position_embeddings", None) or (1 << 30)
    rec = record_calls(model, configs, _PROBE_TOKENS, state_layers=state_layers)
    if not rec.calls and not state_layers:
        raise UnsupportedModelError(
            f"{name} does not attend through transformers' attention interface (no call reached "
            "it): cb_kernels cannot run its attention on the paged cache")
    plans: dict = {}
    seen_modules: dict = {}
    pattern_of: dict = {}
    for call in rec.calls:
        cls = type(call.module).__name__
        if call.layer_idx is None:
            raise UnsupportedModelError(f"{name}: attention module {cls} has no layer_idx")
        idx = call.layer_idx
        if idx in plans or seen_modules.get(idx, call.module) is not call.module:
            raise UnsupportedModelError(
                f"{name} calls attention more than once for layer_idx {idx} in one forward "
                "(repeated layer indices: one call's K/V would overwrite another's)")
        seen_modules[idx] = call.module
        if not 0 <= idx < num_layers:
            raise UnsupportedModelError(
                f"{name}: attention layer_idx {idx} outside [0, num_hidden_layers={num_layers})")
        kwargs = call.kwargs
        unknown = sorted(k for k, v in kwargs.items()
                         if k not in _KNOWN_KWARGS and v is not None)
        if unknown:
            raise UnsupportedModelError(
                f"{name}: layer {idx}'s attention call passes {unknown}, which cb_kernels' "
                "attention does not apply")
        if kwargs.get("is_causal") is False or getattr(call.module, "is_causal", True) is False:
            raise UnsupportedModelError(f"{name}: layer {idx} attends bidirectionally "
                                        "(is_causal=False)")
        if kwargs.get("head_mask") is not None or kwargs.get("layer_head_mask") is not None:
            raise UnsupportedModelError(f"{name}: layer {idx} passes a head mask")
        sinks = kwargs.get("s_aux") is not None
        if sinks and tuple(kwargs["s_aux"].shape) != (call.num_heads,):
            raise UnsupportedModelError(
                f"{name}: layer {idx}'s attention sinks have shape "
                f"{tuple(kwargs['s_aux'].shape)}, not one logit per query head "
                f"({call.num_heads})")
        if call.num_heads % call.num_kv_heads:
            raise UnsupportedModelError(
                f"{name}: layer {idx} has {call.num_heads} query heads over "
                f"{call.num_kv_heads} KV heads (not a multiple)")
        if call.v_head_dim > call.head_dim:
            raise UnsupportedModelError(
                f"{name}: layer {idx}'s value head size {call.v_head_dim} is larger than its "
                f"key head size {call.head_dim}")
        window = chunk = None
        if call.mask is None:
            window = kwargs.get("sliding_window")
        elif call.mask[0] == "fn":
            key = id(call.mask[1])
            if key not in pattern_of:
                pattern_of[key] = mask_pattern(call.mask[1], max_positions, _PROBE_TOKENS)
            kind, value = pattern_of[key]
            if kind == "window":
                window = value
            elif kind == "chunk":
                chunk = value
            elif kind == "other":
                raise UnsupportedModelError(f"{name}: layer {idx}'s attention mask is not "
                                            f"supported: {value}")
        elif call.mask[0] == "tensor":
            if not tensor_is_causal(call.mask[1]):
                raise UnsupportedModelError(
                    f"{name}: layer {idx} gets an attention mask the model built or changed "
                    "itself (an ALiBi or other bias, or a non-causal pattern), which cb_kernels' "
                    "attention does not apply")
        else:
            raise UnsupportedModelError(f"{name}: layer {idx} gets a {call.mask[1]} mask")
        plans[idx] = LayerAttention(call.num_kv_heads, call.head_dim, call.v_head_dim, window,
                                    chunk, sinks)
    cache_windows = _cache_windows(cfg, num_layers)
    for idx, plan in plans.items():
        cw = cache_windows[idx] if idx < len(cache_windows) else None
        if cw is not None and cw != plan.window and plan.chunk is None:
            raise UnsupportedModelError(
                f"{name}: layer {idx}'s attention mask has "
                f"{'no window' if plan.window is None else f'a window of {plan.window}'} but "
                f"transformers' cache keeps a window of {cw} keys (config.sliding_window): "
                "generate() then attends to all keys in the prompt and to the last window "
                "while decoding, which cb_kernels does not reproduce")
    check_positions(model, configs, _PROBE_TOKENS, state_layers)
    layer_types = getattr(cfg, "layer_types", None) or []
    stateless = {i for i, t in enumerate(layer_types) if t in STATELESS_LAYER_TYPES}
    missing = [i for i in range(num_layers)
               if i not in plans and i not in state_layers and i not in stateless]
    if missing:
        raise UnsupportedModelError(
            f"{name}: layers {missing} run no attention through transformers' attention "
            "interface (stateful or custom layers), so cb_kernels cannot run them on its cache")
    chunks = {p.chunk for p in plans.values()} - {None}
    if len(chunks) > 1:
        raise UnsupportedModelError(f"{name}: chunked-attention layers with different chunk "
                                    f"sizes {sorted(chunks)}")
    return [plans.get(i) for i in range(num_layers)]


def check_chunk_blocks(layers: list, block_size: int) -> None:
    """Chunked layers read the cache from their chunk's first block: the chunk size must be a
    multiple of the block size (raises UnsupportedModelError naming both)."""
    chunk = next((p.chunk for p in layers if p.chunk), None)
    if chunk and chunk % block_size:
        raise UnsupportedModelError(
            f"chunked attention with chunks of {chunk} tokens needs a block_size that divides "
            f"it (got block_size={block_size}): set EngineConfig(block_size=...) accordingly")
