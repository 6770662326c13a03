"""What a stateful layer's own forward reads and writes its state through, per family, backed by
one sequence group's slots (runner/state_switch.py gathers and scatters them around each call).

  * transformers' linear-attention cache interface (`get_conv_state` / `get_recurrent_state` /
    `update_*_state`: 5.24's Mamba, Mamba2, gated delta-net, short-conv, ... mixers; 5.17's
    `cache.layers[layer_idx]` reads): `SlotCache` over a `LinearAttentionLayer`;
  * MiniMax's lightning attention (`get_linear_cache` / `set_linear_cache`): one state per layer,
    kept as recurrent state 0 of the same `SlotCache`;
  * blocks that keep their state on the module rather than in a cache (`MODULE_STATE`:
    RecurrentGemma's recurrent block): the switch sets those attributes from the slots around
    each call with use_cache=True and reads them back (`get_path` / `set_path`).
"""
from __future__ import annotations

from typing import Optional

import torch

# Stateful blocks that keep their state on the module instead of a cache (class name -> the
# attribute paths of its conv window and recurrent state). RecurrentGemma's recurrent block: its
# forward with use_cache=True continues from `conv1d_state` and `rg_lru.recurrent_states`.
MODULE_STATE = {
    "RecurrentGemmaRecurrentBlock": (("conv", "conv1d_state"),
                                     ("recurrent", "rg_lru.recurrent_states")),
}


class SlotCache:
    """What a stateful layer's forward calls on its `cache` argument, for one layer and one group:
    backed by a transformers LinearAttentionLayer whose states are the group's gathered slots."""

    def __init__(self, layer_idx: int, layer):
        self.layer_idx = layer_idx
        self.layer = layer
        self.touched: set = set()   # (kind, state_idx) read or written: what goes back to slots

    def check(self, layer_idx):
        if layer_idx != self.layer_idx:
            raise RuntimeError(f"layer {self.layer_idx}'s module asked for layer {layer_idx}'s "
                               "state")

    def get_conv_state(self, layer_idx, state_idx=0):
        self.check(layer_idx)
        if self.layer.has_previous_state[state_idx]:
            self.touched.add(("conv", state_idx))     # a decode updates it in place
            return self.layer.conv_states[state_idx]
        return None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        self.check(layer_idx)
        if self.layer.has_previous_state[state_idx]:
            self.touched.add(("recurrent", state_idx))
            return self.layer.recurrent_states[state_idx]
        return None

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        """The window the layer convolves next, contiguous: the layers hand in a transposed
        slice of their projection, on which torch's CPU depthwise conv1d takes a slow path
        (32 ms against 0.064 ms for [1, 512, 103], same bits, 2 threads)."""
        self.check(layer_idx)
        self.touched.add(("conv", state_idx))
        return self.layer.update_conv_state(conv_states, state_idx, **kwargs).contiguous()

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.check(layer_idx)
        self.touched.add(("recurrent", state_idx))
        return self.layer.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    @property
    def layers(self):
        """transformers 5.17's layers read their states as `cache.layers[layer_idx].conv_states[i]`
        (and `.recurrent_states`, `.record_past`) where 5.24's call get_conv_state; a decode then
        updates the conv window in place, so every state the layer holds goes back to its slot."""
        return _LayerIndex(self)

    def has_previous_state(self, layer_idx=None, state_idx=None):
        if state_idx is None:
            return all(self.layer.has_previous_state.values())
        return self.layer.has_previous_state[state_idx]

    def is_recording_past(self, layer_idx=None) -> bool:
        return False

    # MiniMaxCache's interface: the layer's one state is recurrent state 0.
    def get_linear_cache(self, layer_idx):
        return self.get_recurrent_state(layer_idx, 0)

    def set_linear_cache(self, layer_idx, linear_cache):
        self.check(layer_idx)
        self.touched.add(("recurrent", 0))
        self.layer.update_recurrent_state(linear_cache, 0)
        self.layer.has_previous_state[0] = True


class _LayerIndex:
    """`SlotCache.layers`: the gathered layer at its own index, the states it holds marked
    touched."""

    def __init__(self, cache: SlotCache):
        self.cache = cache

    def __getitem__(self, layer_idx):
        cache = self.cache
        cache.check(layer_idx)
        layer = cache.layer
        for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            cache.touched.update((kind, si) for si, t in states.items()
                                 if t is not None and layer.has_previous_state[si])
        return layer


def gathered_layer(entry: dict, slots: torch.Tensor, continuing: bool, number_of_states: int):
    """A LinearAttentionLayer holding the group's states: copies of its slots when it continues,
    zeros when it starts at token 0 (the layer's prefill path then fills them)."""
    from transformers.cache_utils import LinearAttentionLayer

    layer = LinearAttentionLayer(number_of_states=number_of_states)
    for (kind, si), pool in entry.items():
        if continuing:
            state = pool.index_select(0, slots)
        else:
            state = pool.new_zeros((slots.shape[0], *pool.shape[1:]))
        if kind == "conv":
            layer.conv_states[si] = state
            layer.is_conv_states_initialized[si] = True
            layer.conv_kernel_size[si] = state.shape[-1]
        else:
            layer.recurrent_states[si] = state
            layer.is_recurrent_states_initialized[si] = True
        layer.has_previous_state[si] = continuing
        layer.dtype, layer.device = state.dtype, state.device
    return layer


def scatter(entry: dict, layer, slots: torch.Tensor, layer_idx: int,
            only: Optional[set] = None) -> None:
    """The group's states back into its slots; `only`: the (kind, state_idx) the call touched
    (None: all), so a layer's other modules' states stay as they are."""
    for (kind, si), pool in entry.items():
        if only is not None and (kind, si) not in only:
            continue
        state = (layer.conv_states if kind == "conv" else layer.recurrent_states)[si]
        if state is None or tuple(state.shape) != (slots.shape[0], *pool.shape[1:]):
            raise RuntimeError(
                f"layer {layer_idx}'s {kind} state {si} came back with shape "
                f"{None if state is None else tuple(state.shape)}, its slots hold "
                f"{tuple(pool.shape[1:])} per sequence")
        pool.index_copy_(0, slots, state.to(pool.dtype))


def get_path(obj, path: str):
    """`obj.a.b` for path "a.b" (None where an attribute is missing)."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def set_path(obj, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, last, value)
