"""Our attention inside transformers' own forward: paged KV writes and paged attention per layer.

Inside each attention layer our function replaces the model's: it writes the new K/V with
`ops.write_kv_unchecked` (the slots were checked on the host by step_inputs.pack) and attends
with `ops.paged_attention`. No transformers cache object exists and no mask is built: our name is
registered as an attention function but not as a mask function, so transformers' mask builders
return None at their first check (5.17 .. 5.24), before `find_packed_sequence_indices`, which
reads the position ids on the host (one device sync per mask type and step on CUDA).

The per-step metadata (`AttentionMetadata`) travels as the forward kwarg `cbk_step`; transformers
hands unknown forward kwargs down to every attention call (5.17 .. 5.24). Some decoder layers do
not pass them on (stablelm, nemotron): for those the runner also sets the step in this
thread's forward context for the duration of the forward (runner/forward_context.py), which our
function reads when the kwarg is missing. Each layer's window, K/V head sizes and sinks come from the construction
probe (runner/attention_layers.py), not from the call. Without a cache object
the 5.23 -> 5.24 change (who calls cache.update) does not reach us: both versions pass the new,
rotated K/V to the attention function.

The user's model is not changed between steps: `config._attn_implementation` of the model's
configs is switched to our name for the duration of one forward (`AttentionSwitch`) and restored
right after, so model.generate() keeps working with its own attention. That switch (and the packed
linears' forwards) is state of the model, not of one runner: two Engines on one model stepping in
two threads hold one lock per model around it (`model_lock`), else one would restore the model
under the other's running forward (its later layers would then run sdpa without a mask).
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from typing import Optional

import torch

from cb_kernels import ops
from cb_kernels.runner import forward_context
from cb_kernels.runner.step_inputs import AttentionMetadata

ATTN_NAME = "cb_kernels_engine"
# One lock per model object, shared by every runner of it. Engines do not know each other, the
# model is what they share; a weak map, since a lock stored on the model would stop it from being
# pickled or deep-copied.
_MODEL_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """The lock held while an engine step switches `model`'s attention and linears."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """query: [1, num_heads, num_tokens, head_dim]; key/value: [1, num_kv_heads, num_tokens,
    head_dim] (new tokens only). Returns ([1, num_tokens, num_heads, head_dim], None)."""
    step: Optional[AttentionMetadata] = kwargs.get("cbk_step") or forward_context.current().attn
    if step is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} runs only inside "
                           "cb_kernels.Engine steps")
    layer, layout = module.layer_idx, step.layout
    k_cache, v_cache = layout.k_caches[layer], layout.v_caches[layer]
    softcap = kwargs["softcap"] if "softcap" in kwargs else layout.softcap
    sinks = kwargs.get("s_aux")              # gpt-oss' per-head sink logits [num_heads]
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    # [1, H, T, D] -> [T, H, D] views: the kernels take any strides with head_dim packed, so
    # no copy unless the KV cache has another dtype than the model.
    q = _packed(query[0].transpose(0, 1).to(k_cache.dtype))
    k = _packed(key[0].transpose(0, 1).to(k_cache.dtype))
    v = value[0].transpose(0, 1).to(k_cache.dtype)
    v_dim = v.shape[-1]
    if v_dim != v_cache.shape[-1]:
        # Latent attention: V is stored padded with zeros to K's head size; the padded output
        # columns are sums of zeros and are cut off, so the kept ones are exact.
        v = torch.nn.functional.pad(v, (0, v_cache.shape[-1] - v_dim))
    ops.write_kv_unchecked(k, _packed(v), k_cache, v_cache, step.slot_mapping)
    view = step.chunked if layer < len(layout.chunked_layers) and layout.chunked_layers[layer] \
        else step
    out = ops.paged_attention(q, k_cache, v_cache, view.block_tables, view.seq_lens,
                              view.cu_seqlens_q, scale=scaling,
                              sliding_window=layout.sliding_windows[layer], softcap=softcap,
                              backend=layout.backend, sinks=sinks)
    if v_dim != out.shape[-1]:
        out = out[..., :v_dim]
    return out.to(query.dtype).unsqueeze(0), None


def _packed(x: torch.Tensor) -> torch.Tensor:
    """x itself when head_dim is packed (stride 1), the kernels' one layout need; else a copy
    (a model whose K is a slice along head_dim, e.g. inkling)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def register_attention() -> None:
    """Add our attention function to transformers' registry (a new key only; idempotent). No
    mask function is registered on purpose: see the module docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, engine_attention)


def text_config(model):
    """The config of the model's text decoder (a multimodal model's text part, else its own)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


@contextlib.contextmanager
def attention_named(configs: list, name: str):
    """Inside it every config of `configs` names `name` as its attention implementation; the
    previous names come back on exit (also on an error). The one place that switches it."""
    saved = [cfg._attn_implementation_internal for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation_internal = name
        yield
    finally:
        for cfg, old in zip(configs, saved):
            cfg._attn_implementation_internal = old


def _configs_of(model) -> list:
    from transformers import PretrainedConfig

    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


class AttentionSwitch:
    """Context manager: inside it every config of `model` names our attention; leaving restores
    the names it had. Holds the model's lock (`model_lock`) for the duration."""

    def __init__(self, model):
        register_attention()
        self.configs = _configs_of(model)
        self.lock = model_lock(model)
        self.per_call = PerCallLayerIdx(model)
        self._named = None

    def __enter__(self) -> "AttentionSwitch":
        self.lock.acquire()
        self._named = attention_named(self.configs, ATTN_NAME)
        self._named.__enter__()
        self.per_call.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.per_call.__exit__()
        self._named.__exit__(None, None, None)
        self.lock.release()


class PerCallLayerIdx(forward_context.ForwardSwap):
    """Context manager for attention modules shared by several layers (Zamba2's one attention
    block, built with layer_idx=-1, whose forward takes the calling layer's `layer_idx`): inside
    it each such module's forward sets `module.layer_idx` to the call's layer_idx for the call,
    so our attention (which reads module.layer_idx) uses that layer's KV cache. Restored on
    exit; a no-op for models without such modules."""

    def __init__(self, model):
        self.modules = []
        for module in model.modules():
            fwd = getattr(type(module), "forward", None)
            if fwd is None or not isinstance(getattr(module, "layer_idx", None), int):
                continue
            try:
                params = list(inspect.signature(fwd).parameters)
            except (TypeError, ValueError):
                continue
            if "layer_idx" in params and "layer_idx" in _source_of(type(module)):
                self.modules.append((module, params.index("layer_idx") - 1))

    def forwards(self):
        return [(module, _per_call(module, pos)) for module, pos in self.modules]


def _source_of(cls) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _per_call(module, pos: int):
    original = type(module).forward.__get__(module)

    def forward(*args, **kwargs):
        idx = kwargs["layer_idx"] if "layer_idx" in kwargs else \
            args[pos] if len(args) > pos else None
        if not isinstance(idx, int):
            return original(*args, **kwargs)
        saved = module.layer_idx
        module.layer_idx = idx
        try:
            return original(*args, **kwargs)
        finally:
            module.layer_idx = saved

    return forward
