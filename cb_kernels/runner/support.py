"""Which transformers causal LMs the engine runs, decided once, at Engine() construction.

The rule: a model either gives `model.generate`'s tokens or is refused here with
`UnsupportedModelError` naming the feature; nothing structural may first fail inside a step.

What is checked, and how:
  * statically, from the config and the module tree: a config with no attention heads (a pure
    state-space model), layer types other than full / sliding / chunked attention, and modules
    that carry state between steps (Mamba / SSM mixers, causal convolutions, linear attention,
    recurrences) or read the attention mask outside attention (sparse-attention indexers);
  * by one probe forward of a few tokens, with a recording attention function and a recording
    mask function registered under our own names (`probe`): which module calls attention with
    which layer_idx and how often, the real K and V shapes of every layer (latent attention and
    per-layer head sizes differ from the config's head_dim), the keyword arguments the call
    receives (sinks, an is_causal=False, kwargs a decoder layer drops), and which mask each
    layer gets. A mask is classified by evaluating its mask function (full causal, a sliding
    window of W keys, chunks of C tokens, or anything else); that, not a config field, is what
    transformers' own sdpa/eager path applies, so phimoe's window (no `layer_types`) is found
    as well as Gemma's.
The probe's attention returns zeros: only shapes and call patterns matter, and it costs one
small forward.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.runner.attention import (PerCallLayerIdx, attention_named, model_lock,
                                         text_config)
from cb_kernels.runner.masks import mask_pattern, tensor_is_causal
from cb_kernels.runner.positions import explicit_positions, position_modules
from cb_kernels.runner.state_cache import StateSwitch


class UnsupportedModelError(NotImplementedError):
    """The model uses a feature the engine does not handle; the message names it."""


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
# Class names of layers whose output depends on state carried from earlier tokens outside the
# attention K/V (state-space and recurrent mixers, causal convolutions, linear attention).
_STATEFUL = re.compile(r"Mamba|SSM|Ssm|Mixer|LinearAttention|LinearAttn|DeltaNet|Lightning|"
                       r"Rwkv|RWKV|xLSTM|Mlstm|Slstm|Recurrent|Rglru|RgLru|ShortConv|Conv1d|"
                       r"ConvLayer|Lfm2.*Conv|ShortConvolution")
_INDEXER = re.compile(r"Indexer")
# Classes named like a family's stateful mixer that hold no state themselves (MambaRMSNorm).
_STATELESS_PARTS = re.compile(r"(Norm|NormGated|MLP|Mlp|Embeddings?|Experts|Router|MoE|Moe|MoeBlock)$")


def _attends(cls) -> bool:
    """Whether the class calls transformers' attention interface (KimiLinearAttention: the
    family's name, not linear attention); the probe checks those calls."""
    import inspect

    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention",
                          None}
# Layers with neither attention nor state (a bare MLP / MoE block between mixers, Nemotron-H).
_STATELESS_LAYER_TYPES = {"mlp", "moe"}


def num_heads_of(cfg) -> int:
    """config.num_attention_heads, or 0 where the config has none (or only per layer)."""
    try:
        return getattr(cfg, "num_attention_heads", None) or 0
    except Exception:                         # noqa: BLE001 (a per-layer attribute raises)
        return 0


def _decoder_layers(model, num_layers):
    """(name, module) of the decoder layers' modules: the ModuleLists of num_hidden_layers
    entries inside the decoder (a vision or audio tower's convolutions run once over their
    input and are no state of the decoder); the whole decoder where no such list is found."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, torch.nn.Module):
        decoder = model
    lists = [(n, m) for n, m in decoder.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    roots = lists or [("", decoder)]
    for root_name, root in roots:
        for name, module in root.named_modules(prefix=root_name):
            yield name, module


def static_check(model, state_layers: Optional[dict] = None) -> None:
    """Raises UnsupportedModelError for what the config and module tree already show.
    `state_layers` (layer_idx -> module, runner/state_cache.state_modules): the stateful layers
    the engine keeps state slots for; their modules and layer types are not refused."""
    cfg = text_config(model)
    name = type(model).__name__
    state_layers = state_layers or {}
    if not hasattr(cfg, "num_attention_heads") and not state_layers:
        raise UnsupportedModelError(
            f"{name}'s config has no num_attention_heads and no layer keeps its state through "
            "transformers' cache interface (RWKV and xLSTM have their own state objects): "
            "cb_kernels runs layers that attend through transformers' attention interface or "
            "keep conv / recurrent state through its linear-attention cache")
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted({t for i, t in enumerate(layer_types)
                  if t not in _ATTENTION_LAYER_TYPES and i not in state_layers
                  and t not in _STATELESS_LAYER_TYPES}, key=str)
    if odd:
        raise UnsupportedModelError(
            f"{name} has layers of type {odd} (config.layer_types) that cb_kernels does not "
            "run: no module of theirs attends through transformers' attention interface or "
            "keeps its state through transformers' conv / recurrent cache interface (Mamba, "
            "gated delta-net, short convolution mixers use it; RecurrentGemma's RG-LRU keeps "
            "its state on the module)")
    # The stateful modules, what they contain and what contains them (their decoder layers,
    # e.g. JambaMambaDecoderLayer) are no unknown state.
    stateful = [m for group in state_layers.values() for m in group]
    inside_state = {id(m) for mod in stateful for m in mod.modules()}
    if state_layers:
        named = dict(model.named_modules())
        state_ids = {id(m) for m in stateful}
        for qual, mod in named.items():
            if id(mod) in state_ids:
                parts = qual.split(".")
                inside_state.update(id(named[".".join(parts[:k])]) for k in range(len(parts)))
        # The attention layers' decoder layers are of the stateful layers' decoder-layer class
        # (RecurrentGemmaDecoderLayer): no state of their own either.
        ancestor_classes = {type(m) for m in named.values() if id(m) in inside_state}
        inside_state.update(id(m) for m in named.values() if type(m) in ancestor_classes)
    for mod_name, module in _decoder_layers(model, getattr(cfg, "num_hidden_layers", None)):
        if id(module) in inside_state:
            continue
        cls = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) or (
                _STATEFUL.search(cls) and not _STATELESS_PARTS.search(cls)
                and not (state_layers and _attends(type(module)))):
            raise UnsupportedModelError(
                f"{name} has a stateful layer {mod_name} ({cls}) that keeps its state outside "
                "transformers' linear-attention cache interface (get_conv_state / "
                "get_recurrent_state): cb_kernels keeps state slots only for layers using that "
                "interface")
        if _INDEXER.search(cls):
            raise UnsupportedModelError(
                f"{name} has a sparse-attention indexer {mod_name} ({cls}): it reads the "
                "attention mask outside the attention function, which cb_kernels does not build")
    if getattr(cfg, "index_topk", None):
        raise UnsupportedModelError(
            f"{name} uses a sparse-attention indexer (config.index_topk): not supported")


# -- the probe ----------------------------------------------------------------------------------
PROBE_NAME = "cb_kernels_probe"
_PROBE = threading.local()     # the recording of the probe running in this thread


@dataclass
class _Call:
    module: object
    layer_idx: Optional[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    mask: object          # ("fn", mask_function) | ("tensor", tensor) | None
    kwargs: dict
    query: Optional[torch.Tensor] = None     # [num_heads, num_tokens, head_dim], a copy


class _Recording:
    def __init__(self):
        self.calls: list = []
        self.masks: dict = {}     # data_ptr of a marker tensor -> the mask function it stands for


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    rec: _Recording = _PROBE.rec
    mask = None
    if isinstance(attention_mask, torch.Tensor):
        fn = rec.masks.get(attention_mask.untyped_storage().data_ptr())
        mask = ("fn", fn) if fn is not None else ("tensor", attention_mask.detach().clone())
    elif attention_mask is not None:
        mask = ("other", type(attention_mask).__name__)
    rec.calls.append(_Call(module, getattr(module, "layer_idx", None), query.shape[1],
                           key.shape[1], key.shape[-1], value.shape[-1], mask,
                           {k: v for k, v in kwargs.items()}, query[0].detach().float().clone()))
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    return out, None


def _probe_mask(batch_size=1, q_length=1, kv_length=1, mask_function=None, **kwargs):
    marker = torch.zeros(batch_size, 1, q_length, kv_length, dtype=torch.bool,
                         device=kwargs.get("device", "cpu"))
    _PROBE.rec.masks[marker.untyped_storage().data_ptr()] = mask_function
    return marker


def _register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)


def record_calls(model, configs, num_tokens: int = 6, ids=None, offset: int = 0,
                 state_layers: Optional[dict] = None) -> _Recording:
    """One forward of `num_tokens` tokens (ids, default a fixed mix) at positions offset ..
    offset + num_tokens - 1 with the recording attention; the calls it made."""
    _register_probe()
    rec = _Recording()
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    if ids is None:
        ids = (torch.arange(num_tokens, device=device)[None] * 7 + 3) % vocab
    pos = torch.arange(offset, offset + num_tokens, device=device)[None]
    _PROBE.rec = rec
    # The model's lock: another engine's step must not switch its attention meanwhile.
    with model_lock(model), StateSwitch(state_layers or {})(None):
        _record(model, configs, ids, pos)
    return rec


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


def _record(model, configs, ids, pos) -> None:
    try:
        with attention_named(configs, PROBE_NAME), torch.inference_mode(), \
                explicit_positions(position_modules(model), pos), PerCallLayerIdx(model):
            model(input_ids=ids, position_ids=pos, use_cache=False, cbk_step=_SENTINEL)
    except UnsupportedModelError:
        raise
    except Exception as e:                    # noqa: BLE001
        raise UnsupportedModelError(
            f"{type(model).__name__}'s forward fails under cb_kernels' attention "
            f"({type(e).__name__}: {e})") from e
    finally:
        _PROBE.rec = None


_SENTINEL = object()
_PROBE_TOKENS = 6


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


# -- the plan -----------------------------------------------------------------------------------
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
    stateless = {i for i, t in enumerate(layer_types) if t in _STATELESS_LAYER_TYPES}
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


# -- stateful layers ----------------------------------------------------------------------------
class _ProbeSeq:
    """What state_cache.plan reads of a sequence."""

    def __init__(self, start: int):
        self.state_slot = 0
        self.num_computed_tokens = start


def check_state_carry(model, configs, state_layers: dict, specs: dict,
                      num_tokens: int = 10) -> bool:
    """Refuses a model whose stateful layers do not carry their state through our slots the way
    one forward over all tokens does. Three runs through the slot wrappers (runner/state_cache.py)
    with the probe's attention (zeros), one sequence in a 1-slot pool: all `num_tokens` tokens
    at once; the first n - 1 then the last as a decode; the first half then the rest as a later
    prefill chunk. The last token's logits must agree (up to the rounding of a chunked scan
    against a step-by-step one: 64 ulps of the model's dtype relative to the largest logit):
    else the layer reads something our slots do not give it (e.g. its cache's sequence length),
    and a step would compute other tokens than generate().

    Returns whether later prefill chunks must run token by token: some layers' multi-token path
    starts from zero state even when their cache holds one (Mamba's and Falcon-Mamba's full
    sequence scan takes no initial state in transformers 5.24), while their one-token path
    continues from it; such a model is accepted when the chunk, fed one token at a time,
    matches."""
    from cb_kernels.runner.state_cache import StatePool, StateSwitch, plan

    name = type(model).__name__
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(num_tokens, device=device) * 5 + 2) % vocab
    pool = StatePool(specs, 1, device)
    switch = StateSwitch(state_layers, pool)

    def run(pieces):
        start, logits = 0, None
        for n in pieces:
            step = plan([_ProbeSeq(start)], [n], device)
            pos = torch.arange(start, start + n, device=device)[None]
            _register_probe()
            _PROBE.rec = _Recording()
            try:
                with attention_named(configs, PROBE_NAME), switch(step), \
                        explicit_positions(position_modules(model), pos), PerCallLayerIdx(model):
                    out = model(input_ids=ids[None, start:start + n], position_ids=pos,
                                use_cache=False, cbk_step=_SENTINEL)
            finally:
                _PROBE.rec = None
            logits = out.logits[0, -1].float()
            start += n
        return logits

    half = num_tokens // 2
    stepwise = False
    try:
        with model_lock(model), torch.inference_mode():
            whole = run([num_tokens])
            stepped = run([num_tokens - 1, 1])
            chunked = run([half, num_tokens - half])
            scale = whole.abs().max().item()
            tol = 64 * torch.finfo(next(model.parameters()).dtype).eps * scale + 1e-6
            if (chunked - whole).abs().max().item() > tol \
                    and (stepped - whole).abs().max().item() <= tol:
                switch.stepwise = True
                chunked = run([half, num_tokens - half])
                stepwise = True
    except Exception as e:                    # noqa: BLE001
        raise UnsupportedModelError(
            f"{name}'s stateful layers fail when run on cb_kernels' state slots "
            f"({type(e).__name__}: {e})") from e
    for what, got in (("a decode step", stepped), ("a later prefill chunk", chunked)):
        err = (got - whole).abs().max().item()
        if not err <= tol:
            raise UnsupportedModelError(
                f"{name}: its stateful layers continued from cb_kernels' state slots in "
                f"{what} give other logits than one forward over all tokens (max difference "
                f"{err:.3g} of {scale:.3g}): the layers keep state outside transformers' "
                "conv / recurrent cache state")
    return stepwise
