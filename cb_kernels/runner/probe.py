"""The construction probe's forward: the model's own forward with a recording attention function
and a recording mask function registered under our own names; the recording travels in the
forward context (runner/forward_context.py).

It records which module calls attention with which layer_idx and how often, the real K and V
shapes of every layer (latent attention and per-layer head sizes differ from the config's
head_dim), the keyword arguments the call receives (sinks, an is_causal=False, kwargs a decoder
layer drops), each call's queries, and which mask each layer gets (its mask function, or the
tensor the model built). The probe's attention returns zeros: only shapes and call patterns
matter, and it costs one small forward. runner/attention_layers.py reads the recording;
runner/state_carry.py runs the same forward on the state slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.runner import forward_context
from cb_kernels.runner.attention import PerCallLayerIdx, attention_named, model_lock
from cb_kernels.runner.positions import explicit_positions, position_modules
from cb_kernels.runner.state_switch import StateSwitch
from cb_kernels.runner.support import UnsupportedModelError

PROBE_NAME = "cb_kernels_probe"
_SENTINEL = object()           # the cbk_step a probe forward hands its layers


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


class Recording:
    def __init__(self):
        self.calls: list = []
        self.masks: dict = {}     # data_ptr of a marker tensor -> the mask function it stands for


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    rec: Recording = forward_context.current().recording
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
    forward_context.current().recording.masks[marker.untyped_storage().data_ptr()] = mask_function
    return marker


def _register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)


def probe_forward(model, configs, ids: torch.Tensor, pos: torch.Tensor, states: StateSwitch,
                  state=None) -> tuple:
    """(the model's output, its Recording) for one forward of `ids` [1, n] at positions `pos`
    [1, n] with the recording attention; `states`: the stateful layers' wrappers, `state` the
    StateStep they split (None: their own forwards). The caller holds the model's lock."""
    _register_probe()
    rec = Recording()
    with forward_context.entered(recording=rec, state=state), \
            attention_named(configs, PROBE_NAME), states, torch.inference_mode(), \
            explicit_positions(position_modules(model), pos), PerCallLayerIdx(model):
        out = model(input_ids=ids, position_ids=pos, use_cache=False, cbk_step=_SENTINEL)
    return out, rec


def record_calls(model, configs, num_tokens: int = 6, ids=None, offset: int = 0,
                 state_layers: Optional[dict] = None) -> Recording:
    """One forward of `num_tokens` tokens (ids, default a fixed mix) at positions offset ..
    offset + num_tokens - 1 with the recording attention; the calls it made. Raises
    UnsupportedModelError if the forward fails under it."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    if ids is None:
        ids = (torch.arange(num_tokens, device=device)[None] * 7 + 3) % vocab
    pos = torch.arange(offset, offset + num_tokens, device=device)[None]
    # The model's lock: another engine's step must not switch its attention meanwhile.
    with model_lock(model):
        states = StateSwitch(state_layers or {})
        try:
            return probe_forward(model, configs, ids, pos, states)[1]
        except UnsupportedModelError:
            raise
        except Exception as e:                    # noqa: BLE001
            raise UnsupportedModelError(
                f"{type(model).__name__}'s forward fails under cb_kernels' attention "
                f"({type(e).__name__}: {e})") from e
