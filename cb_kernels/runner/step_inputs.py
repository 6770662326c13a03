"""One engine step packed for the model: the new tokens of every scheduled sequence, one after the
other, and the paged-attention metadata every layer shares.

Nothing here reads a device value on the host: write_kv's and paged_attention's index values are
never read on CUDA, so a step's only sync is reading its sampled tokens.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LayerLayout:
    """What the attention layers read that no step changes: built once (the runner's
    allocate_cache), shared by every step.

    k_caches/v_caches: per layer index [num_blocks, block_size, num_kv_heads, head_dim] (None: a
    layer without attention); sliding_windows: per layer, from the model config (a fallback when
    the layer passes none); softcap: the config's attention logit softcap; backend: ops'
    paged_attention backend (None: auto); chunked_layers: per layer, True for the chunked-attention
    layers (llama4), which attend through the step's ChunkedView.
    """

    k_caches: list
    v_caches: list
    sliding_windows: list
    softcap: Optional[float] = None
    backend: Optional[str] = None
    chunked_layers: tuple = ()


@dataclass
class AttentionMetadata:
    """What every attention layer of one step reads: the step's tensors and the static layout.

    slot_mapping: int64 [num_tokens]; block_tables: int32 [num_seqs, max_blocks_per_seq];
    seq_lens: int32 [num_seqs] (KV length including the new tokens); cu_seqlens_q: int32
    [num_seqs + 1]; chunked: the step as chunked-attention layers see it (None without them).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    layout: LayerLayout
    chunked: Optional["ChunkedView"] = None


@dataclass
class ChunkedView:
    """The step as chunked-attention layers see it: each sequence's new tokens split where a
    chunk of chunk_size positions ends, each piece one sequence whose KV starts at its chunk's
    first position (a block boundary: chunk_size % block_size == 0). Same token order as the
    step, so the output rows line up. block_tables: int32 [num_pieces, max_blocks_per_piece];
    seq_lens: int32 [num_pieces]; cu_seqlens_q: int32 [num_pieces + 1]."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor


@dataclass
class StepInputs:
    """A packed step.

    input_ids, positions: int64 [num_tokens] on the device (input_ids may hold PLACEHOLDER rows
    that the engine fills on the device before `execute`); logits_indices: int64 [num_sampled],
    the rows whose next token is wanted, one per entry of `sampled` (the sequences that reach
    their last known token in this step), in order; the engine may append rows after them
    (prompt positions of requests that asked for prompt logprobs).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    attn: AttentionMetadata
    sampled: list
    num_seqs: int
    # Models with stateful layers: the step's split by sequence (runner/state_cache.StateStep).
    state: object = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence and each of them samples (the CUDA-graph path)."""
        return self.input_ids.shape[0] == self.num_seqs == len(self.sampled)


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
    """The host-side check that lets every layer skip write_kv's: each slot inside
    [0, num_slots) and none twice: 5 us for 64 slots, 30 us for 512 on the 2-core dev box, once
    per step instead of once per layer. Raises RuntimeError, since a bad slot here is an engine
    bug, not a user input."""
    if not slots:
        return
    lo, hi = min(slots), max(slots)
    if lo < 0 or hi >= num_slots:
        raise RuntimeError(f"slot {lo if lo < 0 else hi} outside the KV pool [0, {num_slots}): "
                           "the block tables are corrupt")
    if len(set(slots)) != len(slots):
        raise RuntimeError("two tokens of one step map to the same KV slot: the block tables "
                           "are corrupt")


def chunked_view(seqs: list, num_new_tokens: list, block_size: int, chunk_size: int,
                 device: torch.device) -> ChunkedView:
    """The ChunkedView of a step (see there)."""
    tables, lens, cu = [], [], [0]
    for seq, n in zip(seqs, num_new_tokens):
        a, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        while a < end:
            first = a // chunk_size * chunk_size
            b = min(end, first + chunk_size)
            tables.append(seq.block_table[first // block_size:-(-b // block_size)])
            lens.append(b - first)
            cu.append(cu[-1] + b - a)
            a = b
    width = max([len(t) for t in tables] + [1])
    flat = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    tables_t, lens_t, cu_t = upload([array("i", flat), array("i", lens), array("i", cu)], device)
    return ChunkedView(tables_t.view(len(tables), width), lens_t, cu_t)


def pack(seqs: list, num_new_tokens: list, block_size: int, num_slots: int,
         device: torch.device, layout: LayerLayout,
         chunk_size: Optional[int] = None) -> StepInputs:
    """Pack seqs[i]'s next num_new_tokens[i] tokens (from seq.num_computed_tokens on) into one
    varlen step over the static `layout`; `chunk_size`: the chunk of chunked-attention layers,
    if any (adds the ChunkedView)."""
    bs = block_size
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
    check_slots(slots, num_slots)
    parts = [array("q", ids), array("q", positions), array("q", logits_idx),
             array("q", slots), array("i", flat), array("i", seq_lens), array("i", cu)]
    ids_t, pos_t, logits_t, slots_t, tables_t, lens_t, cu_t = upload(parts, device)
    attn = AttentionMetadata(slot_mapping=slots_t, block_tables=tables_t.view(len(seqs), max_blocks),
                             seq_lens=lens_t, cu_seqlens_q=cu_t, layout=layout)
    if chunk_size:
        attn.chunked = chunked_view(seqs, num_new_tokens, block_size, chunk_size, device)
    return StepInputs(ids_t, pos_t, logits_t, attn, sampled, len(seqs))
