"""Tensor parallelism of a transformers decoder: its weights split over the ranks of a
torch.distributed group, in place, and the collectives that put the pieces back together.

Layout (Megatron's; each rank holds 1/N of every split weight):
- attention by KV heads: q_proj, k_proj, v_proj keep the output rows of this rank's heads (query
  heads r*H/N.., KV heads r*KV/N..: the query heads of one KV group stay together), so the
  attention of a rank reads only its own heads and its KV pool holds KV/N heads; o_proj keeps
  the matching input columns, and its output is summed over the ranks (all_reduce);
- the gated MLP by intermediate columns: gate_proj, up_proj keep output rows, down_proj the
  matching input columns, all_reduce after it;
- the LM head by vocabulary rows: each rank scores its slice, all_gather joins the logits, and
  greedy steps gather only each rank's best (value, index): `ShardedHead`;
- the input embedding by vocabulary rows too (a tied head and embedding share one slice): ids of
  other ranks look up zeros, all_reduce sums the rows.
Biases of split outputs are split with them; the bias of a summed output (o_proj, down_proj)
stays on rank 0 alone, so the sum counts it once. The norms stay whole.

The sums and the gather run as forward hooks on the embedding, o_proj, down_proj and the LM head
(so transformers' own forward, and model(x) called on every rank at once, stay exact). They are
marked (`cbk_tp`) so the engine's fast paths know them: packed_linears.has_hooks does not count
them, and the fused forward (runner/fused/) calls `all_reduce_` itself after the packed o_proj
and down_proj. Inside `local_only()` (the forward context's `tp_local`) the hooks skip their
collectives (the embedding still maps ids to its rows): the runner's construction probes run a forward on each rank alone (they read
shapes, and compare a forward with itself). On gloo, small sums are an all_gather and adds in
rank order (`GATHER_SUM_MAX`).

Only Llama-style layouts split here (q/k/v/o_proj, gate/up/down_proj, per decoder layer);
`check_shardable` refuses the rest, and the sizes that do not divide, with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.runner import forward_context
from cb_kernels.runner.attention import text_config

ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


# On gloo a sum of at most this many elements over all ranks runs as all_gather + a local sum in
# rank order: half the round trips of gloo's ring all_reduce. 2 ranks, a [16, 1024] fp32 decode
# activation between 1.8 ms matmuls, 2-core VM: 530 us against 1156 us (back to back 215 / 360).
GATHER_SUM_MAX = 1 << 20


@dataclass
class TPInfo:
    """This rank's place: rank in [0, size) of `group` (the group the model's collectives use).
    gather_sum: small sums go through all_gather (gloo groups)."""

    rank: int
    size: int
    group: object = None
    gather_sum: bool = False


def _layers(model) -> list:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


def info_of(module) -> Optional[TPInfo]:
    """The TPInfo of a model (or of one of its split linears) this module split, else None."""
    return module.__dict__.get("_cbk_tp")


def size_of(model) -> int:
    info = info_of(model)
    return 1 if info is None else info.size


def local_only():
    """Context manager: inside it the hooks skip their collectives (single-rank construction
    probes); the flag is the forward context's `tp_local`."""
    return forward_context.entered(tp_local=True)


def _active() -> bool:
    return not forward_context.current().tp_local


def all_reduce_(x: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """x summed over the ranks, in place (x must be contiguous); returns x. Every rank gets the
    same bits (the gather path adds the parts in rank order on each rank)."""
    if not _active():
        return x
    if info.gather_sum and x.numel() * info.size <= GATHER_SUM_MAX:
        parts = [torch.empty_like(x) for _ in range(info.size)]
        torch.distributed.all_gather(parts, x, group=info.group)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)
    torch.distributed.all_reduce(x, group=info.group)
    return x


def gather_last(x: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """Every rank's x joined along the last dimension, in rank order."""
    if not _active():
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(info.size)]
    torch.distributed.all_gather(parts, x, group=info.group)
    return torch.cat(parts, dim=-1)


def _embed_pre_hook(module, args):
    """Token ids -> this rank's rows (ids of other ranks read row 0, zeroed after)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    ids, start, stop = args[0], module.cbk_vocab_start, module.cbk_vocab_stop
    foreign = (ids < start) | (ids >= stop)
    forward_context.current().tp_foreign = foreign
    return ((ids - start).masked_fill(foreign, 0),) + tuple(args[1:])


def _embed_hook(module, args, out):
    ctx = forward_context.current()
    foreign, ctx.tp_foreign = ctx.tp_foreign, None
    if isinstance(out, torch.Tensor) and foreign is not None:
        out = out.masked_fill(foreign[..., None], 0)
        return all_reduce_(out, module._cbk_tp)
    return out


def _reduce_hook(module, args, out):
    if isinstance(out, torch.Tensor):
        return all_reduce_(out if out.is_contiguous() else out.contiguous(), module._cbk_tp)
    return out


def _gather_hook(module, args, out):
    if isinstance(out, torch.Tensor):
        return gather_last(out, module._cbk_tp)
    return out


_reduce_hook.cbk_tp = _gather_hook.cbk_tp = _embed_pre_hook.cbk_tp = _embed_hook.cbk_tp = True


def is_tp_hook(fn) -> bool:
    return getattr(fn, "cbk_tp", False) is True


def check_shardable(model, size: int) -> None:
    """Raise ValueError (with the numbers) unless `model` splits over `size` ranks here."""
    cfg = text_config(model)
    name = type(model).__name__
    if info_of(model) is not None:
        return                       # split by us before (another Engine on the same model)
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    if getattr(model, "_tp_size", None) or (dtensor is not None and any(
            isinstance(p, dtensor) for p in model.parameters())):
        raise ValueError(f"tensor_parallel_size={size}: {name} was loaded already split by "
                         "transformers (tp_plan, DTensor weights), which this engine does not "
                         "adopt: load the whole model on every rank (no tp_plan) and the Engine "
                         "splits it")
    layers = _layers(model)
    if not layers:
        raise ValueError(f"tensor_parallel_size={size}: {name} has no decoder layers this engine "
                         "knows how to split (model.get_decoder().layers)")
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [f"self_attn.{n}" for n in ATTN_PROJ
                   if not isinstance(getattr(attn, n, None), torch.nn.Linear)] + \
                  [f"mlp.{n}" for n in MLP_PROJ
                   if not isinstance(getattr(mlp, n, None), torch.nn.Linear)]
        if not isinstance(getattr(attn, "head_dim", None), int):
            missing.append("self_attn.head_dim")
        if missing:
            raise ValueError(f"tensor_parallel_size={size}: {name}'s layer {i} lacks the linears "
                             f"{missing}; tensor parallelism splits Llama-style layers "
                             "(self_attn.q/k/v/o_proj, mlp.gate/up/down_proj) only")
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head = model.get_output_embeddings()
    sizes = [("num_key_value_heads", kv), ("num_attention_heads", heads),
             ("intermediate_size", layers[0].mlp.gate_proj.out_features)]
    if isinstance(head, torch.nn.Linear):
        sizes.append(("vocab_size (LM head rows)", head.out_features))
    for what, n in sizes:
        if not isinstance(n, int) or n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {what}={n} of {name}: "
                             f"each rank must hold an equal share; use a size that divides it")
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"tensor_parallel_size={size}: {name}'s output embedding is a "
                         f"{type(head).__name__}, not an nn.Linear to split by vocabulary")


def _record(module, attr: str, split: tuple) -> None:
    """What `shard_of` needs to cut a full tensor of `module.attr`: (dim, start, stop, full
    size), or ("rank0",) for a bias kept whole on rank 0 and zero on the others."""
    module.__dict__.setdefault("_cbk_split", {})[attr] = split


def _keep_rows(linear: torch.nn.Linear, start: int, stop: int) -> None:
    _record(linear, "weight", (0, start, stop, linear.out_features))
    if linear.bias is not None:
        _record(linear, "bias", (0, start, stop, linear.out_features))
    linear.weight = torch.nn.Parameter(linear.weight.detach()[start:stop].clone(),
                                       requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[start:stop].clone(),
                                         requires_grad=False)
    linear.out_features = stop - start


def _keep_cols(linear: torch.nn.Linear, start: int, stop: int, rank: int) -> None:
    _record(linear, "weight", (1, start, stop, linear.in_features))
    if linear.bias is not None:
        _record(linear, "bias", ("rank0",))
    linear.weight = torch.nn.Parameter(linear.weight.detach()[:, start:stop].clone(),
                                       requires_grad=False)
    if linear.bias is not None and rank != 0:      # summed over the ranks: counted once
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = stop - start


def _mark(module, info: TPInfo, hook) -> None:
    module._cbk_tp = info
    if hook is not None:
        module.register_forward_hook(hook)


def shard_model(model, rank: int, size: int, group=None) -> TPInfo:
    """Split `model` in place for `rank` of `size` (check_shardable first). A model split before
    (another Engine on it) is left as it is; returns its TPInfo."""
    done = info_of(model)
    if done is not None:
        if (done.rank, done.size) != (rank, size):
            raise ValueError(f"the model is already split as rank {done.rank} of {done.size}, "
                             f"not rank {rank} of {size}")
        return done
    check_shardable(model, size)
    gloo = torch.distributed.is_initialized() and torch.distributed.get_backend(group) == "gloo"
    info = TPInfo(rank, size, group, gather_sum=gloo)
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    with torch.no_grad():
        for layer in _layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            d = attn.head_dim
            q0, q1 = rank * heads // size * d, (rank + 1) * heads // size * d
            k0, k1 = rank * kv // size * d, (rank + 1) * kv // size * d
            _keep_rows(attn.q_proj, q0, q1)
            _keep_rows(attn.k_proj, k0, k1)
            _keep_rows(attn.v_proj, k0, k1)
            _keep_cols(attn.o_proj, q0, q1, rank)
            inter = mlp.gate_proj.out_features
            i0, i1 = rank * inter // size, (rank + 1) * inter // size
            _keep_rows(mlp.gate_proj, i0, i1)
            _keep_rows(mlp.up_proj, i0, i1)
            _keep_cols(mlp.down_proj, i0, i1, rank)
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                _mark(m, info, None)
            _mark(attn.o_proj, info, _reduce_hook)
            _mark(mlp.down_proj, info, _reduce_hook)
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        vocab = head.out_features
        tied = isinstance(embed, torch.nn.Embedding) and embed.weight is head.weight
        _keep_rows(head, rank * vocab // size, (rank + 1) * vocab // size)
        _mark(head, info, _gather_hook)
        head.cbk_vocab_start = rank * vocab // size
        head.cbk_vocab = vocab
        _split_embedding(embed, info, head.weight if tied else None)
    model._cbk_tp = info
    return info


def _split_embedding(embed, info: TPInfo, tied_weight) -> None:
    """A plain nn.Embedding (whose rows divide) keeps this rank's rows; a lookup then zeroes the
    ids of other ranks and sums over the ranks (all_reduce). `num_embeddings` keeps the whole
    vocabulary (what the engine checks ids against); padding_idx (a training-only marker) is
    dropped. A tied head's slice is the same rows: one Parameter serves both. Anything else
    (a subclass with its own forward, rows that do not divide) stays whole."""
    if type(embed) not in (torch.nn.Embedding,) and not type(embed).__name__.endswith(
            "ScaledWordEmbedding"):
        return
    vocab, size, rank = embed.num_embeddings, info.size, info.rank
    if vocab % size or embed.max_norm is not None:
        return
    start, stop = rank * vocab // size, (rank + 1) * vocab // size
    _record(embed, "weight", (0, start, stop, vocab))
    if tied_weight is not None and tied_weight.shape[0] == stop - start:
        embed.weight = tied_weight
    else:
        embed.weight = torch.nn.Parameter(embed.weight.detach()[start:stop].clone(),
                                          requires_grad=False)
    embed.padding_idx = None
    embed.cbk_vocab_start, embed.cbk_vocab_stop = start, stop
    embed._cbk_tp = info
    embed.register_forward_pre_hook(_embed_pre_hook)
    embed.register_forward_hook(_embed_hook)


def _split_of(model, name: str) -> Optional[tuple]:
    path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    return module.__dict__.get("_cbk_split", {}).get(attr)


def full_shape(model, name: str, shape: tuple) -> tuple:
    """The unsplit shape of parameter `name` (a transformers name of the split model) whose
    local shape is `shape`: a split dimension times the ranks, the rest as they are."""
    split = _split_of(model, name)
    if split is None or split[0] == "rank0":
        return tuple(shape)
    dim, _, _, full = split
    return tuple(full if d == dim else n for d, n in enumerate(shape))


def shard_of(model, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, the unsplit value of parameter `name`: its rows or columns
    (a view), the whole tensor for an unsplit parameter, and for the bias of a summed output
    (o_proj, down_proj) the whole bias on rank 0 and zeros on the others."""
    split = _split_of(model, name)
    if split is None:
        return full
    if split[0] == "rank0":
        return full if info_of(model).rank == 0 else torch.zeros_like(full)
    dim, start, stop, _ = split
    return full.narrow(dim, start, stop - start)


class ShardedHead:
    """The LM head of a split model: `run(rows)` gives this rank's vocabulary slice of the logits.
    logits(): every rank's slices joined (fp32 [S, vocab]); tokens(): the greedy token, from one
    small all_gather of each rank's best (value, global index): the largest value, on ties the
    lowest index (the rank order is the index order), as argmax of the full logits picks it."""

    def __init__(self, run, module: torch.nn.Module):
        self.run, self.module, self.info = run, module, module._cbk_tp

    def _local(self, rows: torch.Tensor) -> tuple:
        """(this rank's slice, whether collectives run): `run` may call the module, whose hook
        would gather, so it runs local_only."""
        active = _active()
        with local_only():
            local = self.run(rows).float()
        return local, active

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        local, active = self._local(rows)
        return gather_last(local, self.info) if active else local

    def tokens(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        local, active = self._local(rows)
        index = local.argmax(dim=-1)           # the first of equal maxima
        value = local.gather(1, index[:, None])[:, 0]
        if not active:
            return index + self.module.cbk_vocab_start
        best = torch.stack([value.double(), (index + self.module.cbk_vocab_start).double()])
        parts = [torch.empty_like(best) for _ in range(self.info.size)]
        torch.distributed.all_gather(parts, best, group=self.info.group)
        every = torch.stack(parts)             # [ranks, 2, S]
        winner = every[:, 0].argmax(dim=0)     # first rank of the largest value
        return every[:, 1].gather(0, winner[None])[0].long()
