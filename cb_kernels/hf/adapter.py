"""Run a transformers causal LM on one engine step through the paged KV cache.

The step is one packed varlen batch: input_ids and position_ids ``[1, num_tokens]`` (the new
tokens of every scheduled sequence, one sequence after the other). Inside each attention layer
our function replaces the model's: it writes the new K/V with `write_kv_unchecked` (the slots
were checked on the host by `prepare`) and attends with `cb_kernels.ops.paged_attention`. No
transformers cache object exists and no mask is built: our name is registered as an attention
function but not as a mask function, so transformers' mask builders return None at their first
check (5.17 .. 5.24), before `find_packed_sequence_indices`, which reads the position ids on the
host (one device sync per mask type and step on CUDA).

Nothing on the per-layer path reads a device value on the host: write_kv's and paged_attention's
index values are never read on CUDA, so a step's only sync is reading its sampled tokens.

The per-step metadata (`StepInputs`) travels as the forward kwarg `cbk_step`; transformers hands
unknown forward kwargs down to every attention call (5.17 .. 5.24). Without a cache object the
5.23 -> 5.24 change (who calls cache.update) does not reach us: both versions pass the new,
rotated K/V to the attention function.

The user's model is not changed between steps: `config._attn_implementation` of the model's
configs is switched to our name for the duration of one forward and restored right after, so
model.generate() keeps working with its own attention. That switch (and the packed linears'
forwards, hf/packed_linears.py) is state of the model, not of one Engine: two Engines on one model
stepping in two threads hold one lock per model around it (`model_lock`), else one would restore
the model under the other's running forward (its later layers then run sdpa without a mask).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import mmap
import threading
import weakref
from array import array
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from cb_kernels import ops
from cb_kernels.hf.fast_llama import LlamaFastPath
from cb_kernels.hf.packed_linears import PackedLinears
from cb_kernels.ops.cache_ops import write_kv_unchecked

ATTN_NAME = "cb_kernels_engine"
# One lock per model object, shared by every adapter of it. Engines do not know each other, the
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


@dataclass
class StepInputs:
    """Metadata of one step, shared by every layer.

    slot_mapping: int64 [num_tokens]; block_tables: int32 [num_seqs, max_blocks_per_seq];
    seq_lens: int32 [num_seqs] (KV length including the new tokens); cu_seqlens_q: int32
    [num_seqs + 1]. k_caches/v_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim].
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    k_caches: list
    v_caches: list
    sliding_windows: list        # per layer, from the model config (fallback when not passed)
    softcap: Optional[float]
    backend: Optional[str]


def _engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """query: [1, num_heads, num_tokens, head_dim]; key/value: [1, num_kv_heads, num_tokens,
    head_dim] (new tokens only). Returns ([1, num_tokens, num_heads, head_dim], None)."""
    step: Optional[StepInputs] = kwargs.get("cbk_step")
    if step is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} runs only inside "
                           "cb_kernels.Engine steps")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by cb_kernels' "
                                  "paged attention")
    layer = module.layer_idx
    k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else step.sliding_windows[layer]
    softcap = kwargs["softcap"] if "softcap" in kwargs else step.softcap
    # [1, H, T, D] -> [T, H, D] views: the kernels take any strides with head_dim packed, so
    # no copy unless the KV cache has another dtype than the model.
    q = query[0].transpose(0, 1).to(k_cache.dtype)
    k = key[0].transpose(0, 1).to(k_cache.dtype)
    v = value[0].transpose(0, 1).to(k_cache.dtype)
    write_kv_unchecked(k, v, k_cache, v_cache, step.slot_mapping)
    out = ops.paged_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens,
                              step.cu_seqlens_q, scale=scaling, sliding_window=window,
                              softcap=softcap, backend=step.backend)
    return out.to(query.dtype).unsqueeze(0), None


_DTYPES = {"q": torch.int64, "i": torch.int32}


def upload(parts: list, device: torch.device, pack: Optional[bool] = None) -> list:
    """The tensors of `parts` (array("q") -> int64, array("i") -> int32) on `device`.

    array + frombuffer: 5 us for 256 ints where torch.tensor(list) takes 36 us (and 220 us vs
    840 us for a 256 x 25 block table), measured on the 2-core bench machine. On CUDA every part
    goes into one pinned buffer (each at an 8-byte aligned offset) and up in one async copy:
    one transfer per step instead of seven, none from pageable memory, which the driver may
    stage synchronously. The results are then views into one device buffer. `pack` (default:
    off the CPU) forces either way, for tests.
    """
    if not (device.type != "cpu" if pack is None else pack):
        return [torch.frombuffer(a, dtype=_DTYPES[a.typecode]) if len(a) else
                torch.empty(0, dtype=_DTYPES[a.typecode]) for a in parts]
    offsets, total = [], 0
    for a in parts:
        offsets.append(total)
        total += -(-len(a) * a.itemsize // 8) * 8
    host = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = memoryview(host.numpy())
    for a, off in zip(parts, offsets):
        buf[off:off + len(a) * a.itemsize] = memoryview(a).cast("B")
    dev = host.to(device, non_blocking=True)
    return [dev[off:off + len(a) * a.itemsize].view(_DTYPES[a.typecode])
            for a, off in zip(parts, offsets)]


def check_slots(slots: list, num_slots: int) -> None:
    """The host-side check that lets every layer skip write_kv's (see the module docstring):
    each slot inside [0, num_slots) and none twice: 5 us for 64 slots, 30 us for 512 on the
    shared 2-core dev box, once per step instead of once per layer. Raises RuntimeError,
    since a bad slot here is an engine bug, not a user input."""
    if not slots:
        return
    lo, hi = min(slots), max(slots)
    if lo < 0 or hi >= num_slots:
        raise RuntimeError(f"slot {lo if lo < 0 else hi} outside the KV pool [0, {num_slots}): "
                           "the block tables are corrupt")
    if len(set(slots)) != len(slots):
        raise RuntimeError("two tokens of one step map to the same KV slot: the block tables "
                           "are corrupt")


def host_zeros(shape, dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """A zero CPU tensor whose pages are mapped lazily, as they are first written.

    torch.zeros writes every page (1.1 s for a 1 GiB pool on the bench machine); a private
    anonymous mapping gets the kernel's zero pages as blocks are first written. `huge_pages`
    asks for 2 MiB pages (MADV_HUGEPAGE). Decode attention reads K/V rows scattered over the
    pool and ran 1.5x faster on them (16 x 2048 tokens, one thread: 10.1 -> 6.75 ms), but on the
    bench machine (THP defrag "madvise") the first write to each huge page compacts memory
    synchronously: 5 ms a fault on average, up to 173 ms, measured as write_kv calls in a fresh
    pool. A short run touches fresh pages all the time, so the engine keeps 4 KiB pages.
    Where mmap is missing, numpy's calloc'd memory does the same.
    """
    nbytes = max(1, torch.empty((), dtype=dtype).element_size() * math.prod(shape))
    buf = None
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        try:
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            buf = None
    if buf is None:
        buf = np.zeros(nbytes, dtype=np.uint8)
    # frombuffer keeps `buf` alive as long as the tensor.
    flat = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
    return flat.view(dtype).view(shape)


def register_attention() -> None:
    """Add our attention function to transformers' registry (a new key only; idempotent). No
    mask function is registered on purpose: see the module docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _engine_attention)


def _configs_of(model) -> list:
    from transformers import PretrainedConfig

    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


class ModelAdapter:
    """Owns the KV pool of one model and runs engine steps on it.

    k_caches/v_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim] on the model's
    device (the offload manager swaps blocks of these lists).
    """

    def __init__(self, model, attention_backend: Optional[str] = None, pack_weights="auto",
                 greedy_head="auto"):
        if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        register_attention()
        self.model = model
        cfg = _text_config(model)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", None) or (1 << 31) - 1
        emb = model.get_input_embeddings()
        self.vocab_size = emb.num_embeddings
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        window = getattr(cfg, "sliding_window", None)
        self.sliding_windows = [window if t == "sliding_attention" else None for t in layer_types]
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.attention_backend = attention_backend
        self._configs = _configs_of(model)
        self._lock = model_lock(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # None off CPU fp32 or when the packed copy does not fit (see hf/packed_linears.py)
        self._packed = PackedLinears.build(model, pack_weights)
        # Our own forward for the Llama family when the model is exactly that (hf/fast_llama.py).
        self._fast = LlamaFastPath.build(model, self._packed, self)
        if self._fast is not None:
            self._fast.enable_greedy_head(greedy_head)
        self._check_layers()
        self.k_caches: list = []
        self.v_caches: list = []
        self.block_size = 0

    def _check_layers(self) -> None:
        found = {getattr(m, "layer_idx", None) for m in self.model.modules()
                 if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")}
        found.discard(None)
        if not found:
            raise TypeError(f"{type(self.model).__name__} has no attention modules with a "
                            "layer_idx: cb_kernels runs models that use transformers' "
                            "attention interface (Llama, Qwen2/3, Mistral, Gemma, ...)")
        if max(found) >= self.num_layers:
            raise TypeError(f"attention layer index {max(found)} >= num_hidden_layers "
                            f"{self.num_layers}")

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Zeros, not empty: a stale NaN in a never-written slot must not reach a kernel that
        # multiplies it by a zero weight.
        self.k_caches = [self._zeros(shape, dtype) for _ in range(self.num_layers)]
        self.v_caches = [self._zeros(shape, dtype) for _ in range(self.num_layers)]
        self.block_size = block_size

    def _zeros(self, shape, dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return host_zeros(shape, dtype)

    def copy_blocks(self, pairs: list) -> None:
        """pairs: (src, dst) block ids, copied in every layer (copy-on-write)."""
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64)
            ops.copy_blocks(self.k_caches, self.v_caches, mapping)

    def prepare(self, seqs: list, num_new_tokens: list):
        """Pack one step. Returns (input_ids [1, T], position_ids [1, T], logits_indices [S'],
        StepInputs, sampled) where `sampled` are the seqs that get a next token this step."""
        bs = self.block_size
        ids, positions, slots, seq_lens, cu, logits_idx, sampled = [], [], [], [], [0], [], []
        max_blocks = 1
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                pos = start
                while pos < end:
                    base = table[pos // bs] * bs
                    stop = min(end, (pos // bs + 1) * bs)
                    slots.extend(range(base + pos % bs, base + pos % bs + stop - pos))
                    pos = stop
            seq_lens.append(end)
            cu.append(cu[-1] + n)
            if end == seq.num_tokens:
                logits_idx.append(cu[-1] - 1)
                sampled.append(seq)
            if len(table) > max_blocks:
                max_blocks = len(table)
        flat = []
        for seq in seqs:
            flat += seq.block_table
            flat += [0] * (max_blocks - len(seq.block_table))
        if self.k_caches:
            check_slots(slots, self.k_caches[0].shape[0] * bs)
        parts = [array("q", ids), array("q", positions), array("q", logits_idx),
                 array("q", slots), array("i", flat), array("i", seq_lens), array("i", cu)]
        ids_t, pos_t, logits_t, slots_t, tables_t, lens_t, cu_t = upload(parts, self.device)
        step = StepInputs(
            slot_mapping=slots_t, block_tables=tables_t.view(len(seqs), max_blocks),
            seq_lens=lens_t, cu_seqlens_q=cu_t, k_caches=self.k_caches, v_caches=self.v_caches,
            sliding_windows=self.sliding_windows, softcap=self.softcap,
            backend=self.attention_backend)
        return ids_t[None], pos_t[None], logits_t, step, sampled

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, logits_indices, step: StepInputs) -> torch.Tensor:
        """Returns logits [len(logits_indices), vocab_size] in fp32."""
        return self._logits(input_ids, position_ids, logits_indices, step)

    @torch.inference_mode()
    def forward_greedy(self, input_ids, position_ids, logits_indices, step: StepInputs):
        """For an all-greedy step: (None, argmax token ids int64 [S]) when the greedy head runs
        (hf/fast_llama.py), else (logits [S, vocab] fp32, None) as forward(). The engine calls
        exactly one of the two per step."""
        fast = self._fast
        if fast is not None and getattr(fast, "greedy", None) is not None and fast.usable():
            return fast.run(input_ids, position_ids, logits_indices, step, greedy=True)
        return self._logits(input_ids, position_ids, logits_indices, step), None

    def _logits(self, input_ids, position_ids, logits_indices, step: StepInputs) -> torch.Tensor:
        if self._fast is not None and self._fast.usable():
            # Switches no attention or forward of the model: needs no lock.
            return self._fast(input_ids, position_ids, logits_indices, step)
        with self._lock:
            saved = [cfg._attn_implementation_internal for cfg in self._configs]
            for cfg in self._configs:
                cfg._attn_implementation_internal = ATTN_NAME
            try:
                with self._packed if self._packed is not None else contextlib.nullcontext():
                    logits = self._run_model(input_ids, position_ids, logits_indices, step)
            finally:
                for cfg, name in zip(self._configs, saved):
                    cfg._attn_implementation_internal = name
        return logits.float()

    def _run_model(self, input_ids, position_ids, logits_indices, step: StepInputs):
        if self._keeps_logits:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             logits_to_keep=logits_indices, cbk_step=step)
            return out.logits[0]
        # A model without logits_to_keep: project every token, keep the last ones.
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         cbk_step=step)
        return out.logits[0, logits_indices]
