"""Which transformers causal LMs the engine runs, decided once, at Engine() construction.

The rule: a model either gives `model.generate`'s tokens or is refused with
`UnsupportedModelError` naming the feature; nothing structural may first fail inside a step.

This module holds the error and the static check, from the config and the module tree: a config
with no attention heads (a pure state-space model), layer types other than full / sliding /
chunked attention, and modules that carry state between steps (Mamba / SSM mixers, causal
convolutions, linear attention, recurrences) outside the state slots, or read the attention mask
outside attention (sparse-attention indexers). The probe forwards that find the rest live in
runner/probe.py (the recording), runner/attention_layers.py (each attention layer's plan, the
positions check) and runner/state_carry.py (stateful layers on our slots).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from cb_kernels.runner.attention import text_config


class UnsupportedModelError(NotImplementedError):
    """The model uses a feature the engine does not handle; the message names it."""


# Class names of layers whose output depends on state carried from earlier tokens outside the
# attention K/V (state-space and recurrent mixers, causal convolutions, linear attention).
_STATEFUL = re.compile(r"Mamba|SSM|Ssm|Mixer|LinearAttention|LinearAttn|DeltaNet|Lightning|"
                       r"Rwkv|RWKV|xLSTM|Mlstm|Slstm|Recurrent|Rglru|RgLru|ShortConv|Conv1d|"
                       r"ConvLayer|Lfm2.*Conv|ShortConvolution")
_INDEXER = re.compile(r"Indexer")
# Classes named like a family's stateful mixer that hold no state themselves (MambaRMSNorm).
_STATELESS_PARTS = re.compile(r"(Norm|NormGated|MLP|Mlp|Embeddings?|Experts|Router|MoE|Moe|MoeBlock)$")
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention",
                          None}
# Layers with neither attention nor state (a bare MLP / MoE block between mixers, Nemotron-H).
STATELESS_LAYER_TYPES = {"mlp", "moe"}


def _attends(cls) -> bool:
    """Whether the class calls transformers' attention interface (KimiLinearAttention: the
    family's name, not linear attention); the probe checks those calls."""
    import inspect

    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


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
    `state_layers` (layer_idx -> module, runner/state_layers.state_modules): the stateful layers
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
                  and t not in STATELESS_LAYER_TYPES}, key=str)
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
