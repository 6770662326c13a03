"""Drop-in backend: transformers' own continuous batching (`model.generate_batch`) on cb_kernels'
paged attention.

    import cb_kernels.hf
    cb_kernels.hf.enable(model)          # once; `cb_kernels.hf.disable()` undoes it
    outputs = model.generate_batch(prompts, generation_config)

Why a patch: transformers' continuous batching accepts only "paged|eager", "sdpa" or flash names,
and for the first two it (a) builds a dense float mask [1, 1, Q, K_total] every step and (b) copies
every sequence's whole K/V out of the paged cache with `index_select` in every layer before calling
the attention function. Its only path that reads the cache in place (a block table) is reserved for
flash-attn on CUDA decode steps. So this module, and only this module, changes three things while
enabled, for models whose attention is "sdpa" and whose layers are all full attention:

1. `attn_mask_is_needed` answers False: no dense mask is built.
2. `PagedAttentionCache.update` writes the new K/V with `cb_kernels.ops.write_kv` into the layer's
   page view `[-1, page_size, num_kv_heads, head_dim]` of transformers' cache (its write rows are
   slots of that view) and, instead of gathering K/V, returns a block table of that view.
3. The "sdpa" attention function is replaced (public `AttentionInterface.register`) by one that
   calls `cb_kernels.ops.paged_attention` on that view and block table when it gets them, and the
   original sdpa function otherwise (plain forward, sliding-window models).

The patched internals exist in the versions listed in SUPPORTED_VERSIONS only (5.18-5.23 have 5.24's
cache but let the attention function update it, handled below; 5.17 lays the cache out
differently); `enable` refuses other versions with an error instead of guessing.
`cb_kernels.Engine` does not depend on these internals.
"""
from __future__ import annotations

import dataclasses

import torch

# Checked by tests/hf/test_dropin.py run under each of these (PYTHONPATH=<a pip --target of it>).
SUPPORTED_VERSIONS = ("5.18", "5.19", "5.20", "5.21", "5.22", "5.23", "5.24")
# 5.18 runs continuous batching under "paged|sdpa", later versions under "sdpa".
SDPA_NAMES = ("sdpa", "paged|sdpa")


def check_version(version: str | None = None) -> None:
    """Raise RuntimeError unless `version` (default: the installed transformers) is supported."""
    if version is None:
        import transformers

        version = transformers.__version__
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"cb_kernels.hf.enable() supports transformers {', '.join(SUPPORTED_VERSIONS)} only (it patches "
            f"continuous-batching internals that differ between versions), found {version}. Use "
            f"cb_kernels.Engine, which does not patch transformers, or install "
            f"transformers=={SUPPORTED_VERSIONS[-1]}.*")


@dataclasses.dataclass
class _Patched:
    """What enable() replaced, to restore on disable()."""

    sdpa: dict       # attention name -> transformers' function
    update: object
    mask_needed: object


_state: dict[str, _Patched] = {}  # the one piece of process state: patches are process-wide by nature


def is_enabled() -> bool:
    return "patched" in _state


def enable(model=None) -> None:
    """Make transformers' continuous batching use cb_kernels' paged attention (idempotent).

    Parameters
    ----------
    model : transformers PreTrainedModel, optional
        When given, its attention implementation is switched to "sdpa" (the name the backend takes
        over) and models it cannot serve are refused with a ValueError.
    """
    check_version()
    if model is not None:
        _check_model(model)
    if is_enabled():
        return
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import input_outputs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    missing = [name for obj, name in ((cb_cache.PagedAttentionCache, "update"),
                                      (input_outputs, "attn_mask_is_needed"))
               if not hasattr(obj, name)]
    if missing:
        raise RuntimeError(f"transformers' continuous batching lacks {missing}: this version is not "
                           f"supported")
    mapping = AttentionInterface._global_mapping
    patched = _Patched(sdpa={name: mapping.get(name, sdpa_attention_forward) for name in SDPA_NAMES
                             if name in mapping or name == "sdpa"},
                       update=cb_cache.PagedAttentionCache.update,
                       mask_needed=input_outputs.attn_mask_is_needed)

    def attn_mask_is_needed(config):
        return False if _serves(config) else patched.mask_needed(config)

    def update(self, *args, **kwargs):
        if not _serves(self.config):
            return patched.update(self, *args, **kwargs)
        return _paged_update(self, *args, **kwargs)

    def make_sdpa(name):
        def sdpa(module, query, key, value, attention_mask, **kwargs):
            cache = kwargs.get("cache")
            if isinstance(cache, cb_cache.PagedAttentionCache) and _serves(cache.config):
                # 5.18-5.23: the attention function updates the cache (5.24: the layer did)
                del kwargs["cache"]
                _paged_update(cache, key, value, module.layer_idx, kwargs)
            if "cbk_block_tables" not in kwargs:
                return patched.sdpa[name](module, query, key, value, attention_mask, **kwargs)
            return _paged_attention(module, query, kwargs)
        return sdpa

    update.__wrapped__ = patched.update
    for name in patched.sdpa:
        AttentionInterface.register(name, make_sdpa(name))
    cb_cache.PagedAttentionCache.update = update
    input_outputs.attn_mask_is_needed = attn_mask_is_needed
    _state["patched"] = patched


def disable() -> None:
    """Restore transformers' own functions (no-op when not enabled)."""
    patched = _state.pop("patched", None)
    if patched is None:
        return
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import input_outputs

    for name, fn in patched.sdpa.items():
        AttentionInterface.register(name, fn)
    cb_cache.PagedAttentionCache.update = patched.update
    input_outputs.attn_mask_is_needed = patched.mask_needed


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate_batch"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not _all_full_attention(config):
        raise ValueError("model: the drop-in backend serves models whose layers are all full attention; "
                         "this one has sliding-window layers (use cb_kernels.Engine)")
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise ValueError("model: attention sinks are not supported by the drop-in backend")
    if config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")


def _all_full_attention(config) -> bool:
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    return set(group_layers_by_attn_type(config)) == {"full_attention"}


def _serves(config) -> bool:
    return config._attn_implementation in SDPA_NAMES and _all_full_attention(config)


@dataclasses.dataclass
class _StepTables:
    """Block tables of one forward step, shared by every layer (they all use the same blocks)."""

    index: torch.Tensor          # the read (or write) index they were derived from; identity = same step
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks_per_seq], page ids of the layer views
    seq_lens: torch.Tensor       # int32 [num_seqs]


def _paged_update(cache, key_states, value_states, layer_idx, kwargs):
    """Write the new K/V into the layer's pages and put what paged attention needs into `kwargs`.

    key_states, value_states: [1, num_kv_heads, num_tokens, head_dim]. Returns them unchanged.
    """
    from cb_kernels import ops

    allocator = cache.layer_to_allocator[layer_idx]
    page_size = allocator.tokens_per_page
    layer_type = "full_attention"   # the only type served; 5.18's allocators do not name theirs
    max_key = "max_length_k" if "max_length_k" in kwargs else "max_seqlen_k"   # 5.18: max_seqlen_k
    cu_seqlens_k, max_len_k = kwargs["cu_seq_lens_k"], kwargs[max_key]
    if isinstance(cu_seqlens_k, dict):
        cu_seqlens_k = cu_seqlens_k[layer_type]
    cu_seqlens_k = cu_seqlens_k.to(torch.int32)
    max_len_k = max_len_k[layer_type] if isinstance(max_len_k, dict) else max_len_k
    kwargs["cu_seq_lens_k"], kwargs[max_key] = cu_seqlens_k, max_len_k
    write_index = kwargs["write_index"][allocator.index]   # int64 [num_tokens], slots of the page view
    read_index = kwargs["read_index"][allocator.index]     # int64 [sum(seq_lens)] or empty
    k_cache, v_cache = allocator.get_cache_for_block_table(layer_idx)  # [-1, page_size, Hkv, D]

    # Strided views [num_tokens, num_kv_heads, head_dim]: the kernels take strides, so no copy.
    key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
    ops.write_kv(key, value, k_cache, v_cache, write_index)

    # Without cached tokens transformers sends an empty read index; the write rows then list every
    # position of every sequence, and cu_seq_lens_k equals cu_seq_lens_q.
    index = read_index if read_index.numel() else write_index
    tables = getattr(cache, "_cbk_step_tables", None)
    if tables is None or tables.index is not index:
        tables = _derive_tables(index, cu_seqlens_k, max_len_k, page_size)
        cache._cbk_step_tables = tables
    kwargs.update(cbk_k_cache=k_cache, cbk_v_cache=v_cache, cbk_block_tables=tables.block_tables,
                  cbk_seq_lens=tables.seq_lens)
    return key_states, value_states


def _derive_tables(index: torch.Tensor, cu_seqlens_k: torch.Tensor, max_len_k: int,
                   page_size: int) -> _StepTables:
    """Page ids of every sequence's blocks, read off transformers' per-token index.

    index: int64 [sum(seq_lens)], the cache row of every position 0..len-1 of each sequence, in
    order; a block's positions sit in one page, so its page id is the row of its first position
    divided by page_size. cu_seqlens_k: int32 [num_seqs + 1].
    """
    seq_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    max_blocks = max(1, -(-int(max_len_k) // page_size))
    block_idx = torch.arange(max_blocks, device=index.device, dtype=torch.int64)
    used = block_idx[None, :] * page_size < seq_lens[:, None]
    first_pos = cu_seqlens_k[:-1, None].to(torch.int64) + block_idx[None, :] * page_size
    first_pos = torch.where(used, first_pos, torch.zeros_like(first_pos))
    pages = torch.where(used, index[first_pos] // page_size, torch.zeros_like(first_pos))
    return _StepTables(index=index, block_tables=pages.to(torch.int32), seq_lens=seq_lens.contiguous())


def _paged_attention(module, query, kwargs):
    """query: [1, num_heads, num_tokens, head_dim] -> ([1, num_tokens, num_heads, head_dim], None)."""
    from cb_kernels import ops

    q = query[0].transpose(0, 1)                           # strided [num_tokens, num_heads, head_dim]
    out = ops.paged_attention(
        q, kwargs["cbk_k_cache"], kwargs["cbk_v_cache"], kwargs["cbk_block_tables"],
        kwargs["cbk_seq_lens"], kwargs["cu_seq_lens_q"].to(torch.int32),
        scale=kwargs.get("scaling", getattr(module, "scaling", None)),
        softcap=getattr(module.config, "attn_logit_softcapping", None))
    return out.unsqueeze(0), None
