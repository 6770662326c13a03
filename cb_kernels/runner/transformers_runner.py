"""TransformersRunner: any transformers causal LM on the paged KV cache (the ModelRunner the
Engine builds by default; runner/base.py states the protocol).

Each step is one packed varlen batch (step_inputs.py). Which forward runs is decided per step,
cheapest first:
  1. a CUDA graph of the whole decode step (cuda_graphs.py), on CUDA for pure-decode batches;
  2. the fused CPU fp32 forward (fused/), when the model is exactly a family it knows and nobody
     hooked it since;
  3. transformers' own forward with our attention (attention.py) and, on CPU fp32, the linears
     on packed weights (packed_linears.py).
The LM head is chosen once (lm_head.py; rebuilt if the model's output embedding is replaced): the
greedy head where it pays and the model's logits are `lm_head(final hidden state)` (the family's
own classes on path 2, a 5-token probe on path 3), else full logits. Path 3 runs the model's own
forward, head included, except on all-greedy steps with the greedy head on and nothing hooked on
the CausalLM module: those run its decoder and then the greedy head.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Optional

import torch

from cb_kernels import ops
from cb_kernels.ops import workspace
from cb_kernels.runner import (attention_layers, forward_context, hybrid_kernels, state_cache,
                               state_layers, step_inputs, support, tensor_parallel)
from cb_kernels.runner.hybrid_layers import HybridForward
from cb_kernels.runner.state_carry import check_state_carry
from cb_kernels.runner.state_switch import StateSwitch
from cb_kernels.runner.attention import AttentionSwitch, model_lock, text_config
from cb_kernels.runner.positions import explicit_positions, position_modules
from cb_kernels.runner.base import StepOutput
from cb_kernels.runner.cuda_graphs import decode_graph_runner, graphs_enabled
from cb_kernels.runner.fused import FusedForward
from cb_kernels.runner.kv_cache import allocate_layer_caches, host_zeros
from cb_kernels.runner.lm_head import GreedyTokensHead, LogitsHead, choose_lm_head, wants_greedy_head
from cb_kernels.runner.packed_linears import PackedLinears, has_hooks

logger = logging.getLogger("cb_kernels")


def eos_ids_of(model) -> frozenset:
    """EOS ids as generate() sees them: the generation config's (the model config's only when
    the model has no generation config)."""
    gen = getattr(model, "generation_config", None)
    ids = gen.eos_token_id if gen is not None else getattr(model.config, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


def _head_is_plain(model, decoder, head) -> bool:
    """Whether model(x).logits is exactly head(decoder(x).last_hidden_state): no softcap, scale or
    other step after the head. One 5-token forward with the model's own attention proves it (under
    the model's lock: another engine's step must not switch its attention meanwhile)."""
    probe = torch.arange(5, device=head.weight.device)[None] % head.weight.shape[0]
    try:
        with model_lock(model), torch.inference_mode():
            logits = model(input_ids=probe, use_cache=False).logits
            hidden = decoder(input_ids=probe, use_cache=False).last_hidden_state
            return torch.equal(logits, head(hidden))
    except Exception:                # noqa: BLE001 (any failure means "not provably plain")
        return False


class TransformersRunner:
    """Runs a transformers causal LM on one engine step through the paged KV cache.

    k_caches/v_caches (after allocate_cache): per layer [num_blocks, block_size, num_kv_heads,
    head_dim] on the model's device (the offload manager swaps blocks of these lists).
    `packed` (PackedLinears or None), `fused` (FusedForward or None) and `head` (LogitsHead) say
    which paths this model gets.
    """

    def __init__(self, model, *, attention_backend: Optional[str] = None, pack_weights="auto",
                 greedy_head="auto", cuda_graphs="auto",
                 available_host_bytes: Optional[int] = None):
        if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        self.model = model
        cfg = text_config(model)
        num_hidden = getattr(cfg, "num_hidden_layers", None) or 0
        self._switch = AttentionSwitch(model)
        self._positions = position_modules(model)   # BART-style decoders (runner/positions.py)
        # Layers with per-sequence state (Mamba, gated delta-net, short conv, ...): kept in state
        # slots beside the KV cache (runner/state_layers.py, state_cache.py, state_switch.py).
        try:
            self.state_layers = state_layers.state_modules(model)
        except ValueError as e:
            raise support.UnsupportedModelError(f"{type(model).__name__}: {e}") from e
        # Refuses, with UnsupportedModelError, what the engine cannot run exactly; else the
        # real per-layer K/V shapes and windows, found by one probe forward (None: a layer with
        # no attention).
        self.layers = attention_layers.layer_plans(model, self._switch.configs, num_hidden,
                                                   self.state_layers)
        self.state_specs: dict = {}
        self.state_bytes_per_seq = 0
        self._stepwise_chunks = False
        if self.state_layers:
            try:
                with model_lock(model):
                    self.state_specs = state_layers.probe_specs(model, self.state_layers)
            except Exception as e:            # noqa: BLE001 (transformers' own failure)
                raise support.UnsupportedModelError(
                    f"{type(model).__name__}: the state of its stateful layers could not be "
                    f"read off transformers' cache ({type(e).__name__}: {e})") from e
            self._stepwise_chunks = check_state_carry(
                model, self._switch.configs, self.state_layers, self.state_specs)
            if self._stepwise_chunks:
                logger.info("stateful layers: later prefill chunks run one token at a time (the "
                            "layers' multi-token path starts from zero state)")
            self.state_bytes_per_seq = state_cache.StatePool.bytes_per_slot(self.state_specs)
            logger.info("stateful layers %s: %d B of state per sequence", sorted(self.state_specs),
                        self.state_bytes_per_seq)
        self._states = StateSwitch(self.state_layers) if self.state_layers else None
        self.state_pool = None
        self.state_tensors: list = []
        kv_plans = [p for p in self.layers if p is not None]
        # Sizing counts the KV of attention layers only; a model without any keeps one
        # 1-value-per-token placeholder layer, so blocks still count its tokens.
        self.num_layers = len(kv_plans) or 1
        # This rank's query heads (a tensor-parallel split keeps 1/size of them).
        self.num_heads = support.num_heads_of(cfg) // tensor_parallel.size_of(model)
        # Sizing reads one (num_kv_heads, head_dim) for every layer: the largest layer's, so a
        # block never holds more than the engine counted.
        if kv_plans:
            widest = max(kv_plans, key=lambda p: p.num_kv_heads * p.head_dim)
            self.num_kv_heads, self.head_dim = widest.num_kv_heads, widest.head_dim
        else:
            self.num_kv_heads = self.head_dim = 1
        self.max_positions = getattr(cfg, "max_position_embeddings", None) or (1 << 31) - 1
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = eos_ids_of(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.sliding_windows = [p.window if p is not None else None for p in self.layers]
        self.chunked_layers = tuple(p is not None and p.chunk is not None for p in self.layers)
        self.chunk_size = next((p.chunk for p in kv_plans if p.chunk), None)
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.attention_backend = attention_backend
        self.cuda_graphs = cuda_graphs
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # None off CPU fp32 or when the packed copy does not fit (runner/packed_linears.py).
        self._pack_args = (pack_weights, available_host_bytes, num_hidden)
        self._greedy_mode = greedy_head
        self._build_weight_paths()
        self.graphs = None
        self.k_caches: list = []
        self.v_caches: list = []
        self.layout: Optional[step_inputs.LayerLayout] = None     # set by allocate_cache
        self.block_size = 0
        self._max_num_seqs = 0
        self._slept_shapes: list = []      # (tensor, shape) of the pool while asleep
        self._weights_released = False
        self._workspace_step: Optional[tuple] = None    # reserve_workspace's (tokens, seqs)

    def _build_weight_paths(self) -> None:
        """The packed copies, the fused forward and the head, from the model's modules as they
        are now (again by refresh_weights when a submodule was replaced)."""
        pack_weights, available_host_bytes, num_hidden = self._pack_args
        self._modules = list(self.model.modules())
        self.packed = PackedLinears.build(self.model, pack_weights, available_host_bytes)
        self.fused = None if self.state_layers else FusedForward.build(
            self.model, self.packed, num_hidden, self.num_heads, self.num_kv_heads)
        self.head, self._decoder = self._choose_head(self._greedy_mode)
        # Hybrid families' own decoder forward (hybrid_layers.py): needs the state pool's kernels.
        self.hybrid = HybridForward.build(self.model, self.packed, self._states.forwards(),
                                          self.layout) if self.state_pool is not None else None

    def _choose_head(self, mode):
        """(head, decoder). head: None when the output embedding is no nn.Linear (the model's
        forward then gives every logit). decoder: the base model that all-greedy steps on
        transformers' path run up to the final hidden state before the greedy head, or None."""
        module = self.model.get_output_embeddings()
        if not isinstance(module, torch.nn.Linear):
            return None, None
        run = self.packed.runner_for(module) if self.packed is not None else module
        if tensor_parallel.info_of(module) is not None:
            # Split by vocabulary: the sharded head gathers logits or each rank's best token.
            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
            plain = self.fused is not None or (
                decoder is not None and decoder is not self.model
                and _head_is_plain(self.model, decoder, module))
            return tensor_parallel.ShardedHead(run, module), decoder if plain else None
        if not wants_greedy_head(mode):
            return LogitsHead(run, module), None
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        plain = self.fused is not None or (
            decoder is not None and decoder is not self.model
            and _head_is_plain(self.model, decoder, module))
        # The hybrid families' own forward (hybrid_layers.py) hands the head its exact input
        # rows; their decoder may not (bf16 Mamba-2's returns the fp32 residual stream's norm).
        # Other models whose probe fails keep the logits head (no int8 copy they never read).
        hybrid = bool(self.state_layers) and type(self.model).__name__ in HybridForward.CLASSES
        if not plain and not hybrid:
            logger.info("greedy_head: off (the model's logits are not its LM head's output)")
            return LogitsHead(run, module), None
        head = choose_lm_head(module, run, mode)
        return head, decoder if isinstance(head, GreedyTokensHead) and plain else None

    def _head_now(self):
        """The head, rebuilt when the model's output embedding was replaced since."""
        if self.head is None or self.model.get_output_embeddings() is not self.head.module:
            self.head, self._decoder = self._choose_head(self._greedy_mode)
        return self.head

    # -- the cache ------------------------------------------------------------------------------
    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       max_num_seqs: int) -> None:
        kv_plans = [p for p in self.layers if p is not None]
        attention_layers.check_chunk_blocks(kv_plans, block_size)
        shapes = [(p.num_kv_heads, p.head_dim) for p in kv_plans] or [(1, 1)]
        self.k_caches, self.v_caches = allocate_layer_caches(shapes, num_blocks, block_size,
                                                             dtype, self.device)
        it_k, it_v = iter(self.k_caches), iter(self.v_caches)
        self.layout = step_inputs.LayerLayout(     # per layer_idx (None: no attention)
            k_caches=[next(it_k) if p is not None else None for p in self.layers],
            v_caches=[next(it_v) if p is not None else None for p in self.layers],
            sliding_windows=self.sliding_windows, softcap=self.softcap,
            backend=self.attention_backend, chunked_layers=self.chunked_layers)
        self.block_size, self._max_num_seqs = block_size, max_num_seqs
        if self.state_layers:
            # One slot per running sequence (the scheduler runs at most max_num_seqs).
            self.state_pool = state_cache.StatePool(self.state_specs, max_num_seqs, self.device)
            self.state_tensors = self.state_pool.tensors
            self._states = StateSwitch(self.state_layers, self.state_pool,
                                       self._stepwise_chunks)
            for line in hybrid_kernels.describe([w for _, w in self._states._wrapped]):
                logger.info("stateful layers: %s", line)
            self.hybrid = HybridForward.build(self.model, self.packed, self._states.forwards(),
                                              self.layout)
        # The decode graphs carry no chunked view, and no state slots.
        if graphs_enabled(self.cuda_graphs, self.device) and self.chunk_size is None \
                and not self.state_layers:
            max_blocks = min(num_blocks, -(-self.max_positions // block_size))
            self.graphs = decode_graph_runner(self, max_num_seqs, max_blocks)

    def reserve_workspace(self, num_tokens: int, num_seqs: int) -> int:
        """Grow this thread's kernel scratch (ops/workspace.py) to what a step of num_tokens
        rows over num_seqs sequences takes on the fused paths and write it once, so the first
        steps fault none of its pages (Engine construction, CPU; again at wake_up); returns the
        bytes held, 0 where no kernel on this model's path takes any (nothing allocated)."""
        self._workspace_step = (num_tokens, num_seqs)
        if self.hybrid is not None:
            need = self.hybrid.workspace_bytes(num_tokens, num_seqs)
        else:
            need = self.fused.workspace_bytes(num_tokens) if self.fused is not None else 0
        return workspace.reserve(need) if need else 0

    def copy_blocks(self, pairs: list) -> None:
        """pairs: (src, dst) block ids, copied in every layer (copy-on-write)."""
        if pairs:
            ops.copy_blocks(self.k_caches, self.v_caches, torch.tensor(pairs, dtype=torch.int64))

    # -- a step ---------------------------------------------------------------------------------
    def prepare(self, seqs: list, num_new_tokens: list) -> step_inputs.StepInputs:
        inputs = step_inputs.pack(
            seqs, num_new_tokens, self.block_size, self.k_caches[0].shape[0] * self.block_size,
            self.device, self.layout, self.chunk_size)
        if self.state_pool is not None:
            inputs.state = state_cache.plan(seqs, num_new_tokens, self.device)
        return inputs

    @torch.inference_mode()
    def execute(self, inputs: step_inputs.StepInputs, greedy: bool = False) -> StepOutput:
        """The sampled rows' logits; with `greedy` (every sampled row is greedy) their argmax
        tokens instead (from the greedy head where it runs, else the argmax of the logits)."""
        out = self._execute_any(inputs, greedy)
        if greedy and out.tokens is None:
            return StepOutput(None, ops.greedy_tokens(out.logits))
        return out

    def _execute_any(self, inputs: step_inputs.StepInputs, greedy: bool) -> StepOutput:
        attn = inputs.attn
        if self.graphs is not None and inputs.is_decode:
            # The graph copies input_ids (placeholders already filled) into its static buffer.
            return StepOutput(self.graphs({
                "input_ids": inputs.input_ids, "positions": inputs.positions,
                "slot_mapping": attn.slot_mapping, "seq_lens": attn.seq_lens,
                "block_tables": attn.block_tables, "cu_seqlens_q": attn.cu_seqlens_q}), None)
        if self.state_pool is not None:
            if self.hybrid is not None and inputs.state is not None and \
                    self._head_now() is not None and self.hybrid.usable():
                # Our own decoder forward: switches nothing of the model, needs no lock.
                return self._execute(inputs, greedy, hybrid=True)
            # The wrappers are state of the model, like the attention switch: under its lock.
            with self._switch.lock, self._states:
                return self._execute(inputs, greedy)
        return self._execute(inputs, greedy)

    def _execute(self, inputs: step_inputs.StepInputs, greedy: bool,
                 hybrid: bool = False) -> StepOutput:
        attn = inputs.attn
        head = self._head_now()
        if hybrid:
            self.packed.refresh()
            rows = self.hybrid(inputs.input_ids, inputs.positions, inputs.logits_indices, attn,
                               inputs.state)
        elif head is not None and self.fused is not None and self.fused.usable():
            # Switches no attention or forward of the model: needs no lock.
            self.packed.refresh()
            rows = self.fused(inputs.input_ids, inputs.positions, inputs.logits_indices, attn)
        elif greedy and self._decoder is not None and not has_hooks([self.model]):
            # The CausalLM's own forward would be lm_head(decoder(...)) (probed); a hook or an
            # instance forward on it sends the step to the model's forward below.
            rows = self._hidden_rows(inputs.input_ids, inputs.positions, inputs.logits_indices,
                                     attn, inputs.state)
        else:
            return StepOutput(self.forward_logits(inputs.input_ids, inputs.positions,
                                                  inputs.logits_indices, attn, inputs.state),
                              None)
        tokens = head.tokens(rows) if greedy else None
        if tokens is not None:
            return StepOutput(None, tokens, greedy_head=True)
        return StepOutput(head.logits(rows), None)

    def _hidden_rows(self, input_ids, positions, logits_indices, attn, state) -> torch.Tensor:
        """transformers' decoder up to the final hidden state: [num_sampled, hidden]."""
        with self._switch, forward_context.entered(attn=attn, state=state), \
                explicit_positions(self._positions, positions), \
                self.packed if self.packed is not None else contextlib.nullcontext():
            hidden = self._decoder(input_ids=input_ids[None], position_ids=positions[None],
                                   use_cache=False, cbk_step=attn).last_hidden_state
        return hidden[0].index_select(0, logits_indices)

    @torch.inference_mode()
    def forward_logits(self, input_ids, positions, logits_indices, attn,
                       state: Optional[state_cache.StateStep] = None) -> torch.Tensor:
        """transformers' forward with our attention: fp32 logits [num_sampled, vocab_size].
        input_ids, positions: int64 [num_tokens]; logits_indices: int64 [num_sampled]; `state`:
        the stateful layers' split (their wrappers installed by the caller)."""
        ids, pos = input_ids[None], positions[None]
        with self._switch, forward_context.entered(attn=attn, state=state), \
                explicit_positions(self._positions, positions), \
                self.packed if self.packed is not None else contextlib.nullcontext():
            if self._keeps_logits:
                out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                                 logits_to_keep=logits_indices, cbk_step=attn)
                return out.logits[0].float()
            # A model without logits_to_keep: project every token, keep the last ones.
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, cbk_step=attn)
        return out.logits[0, logits_indices].float()

    # -- sleep (Engine.sleep / wake_up) ---------------------------------------------------------
    def release_memory(self, kv: bool, weights: bool) -> int:
        """Free the KV pool and state slots (`kv`), the packed weight copies, the greedy head's
        copy, the rotary table and the kernels' scratch (`weights`); returns the bytes freed.
        Every tensor object stays (the layout, the swapper and the engine hold them) with an
        empty storage, until restore_memory. The model's own weights are never touched."""
        freed = 0
        if kv and not self._slept_shapes:
            pool = self.k_caches + self.v_caches + self.state_tensors
            self._slept_shapes = [(t, tuple(t.shape)) for t in pool]
            for t in pool:
                freed += t.numel() * t.element_size()
                t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
            self.graphs = None             # captured the pool's addresses
            if self.fused is not None:     # so did FusedDecoder's layer table
                self.fused.forget_table()
        if weights and not self._weights_released:
            self._weights_released = True
            if self.packed is not None:
                freed += self.packed.release()
            greedy = getattr(self.head, "greedy", None)
            if greedy is not None:
                freed += sum(t.numel() * t.element_size() for t in
                             (greedy.packed, greedy.row_stats, greedy.exact_cols))
            self.head = None               # chosen and packed again by restore_memory
            if self.fused is not None:
                freed += self.fused.forget_table() + self.fused.rotary.forget()
            freed += workspace.release()   # the kernels' scratch, every thread's
        return freed

    def restore_memory(self, kv: bool, weights: bool) -> None:
        """Undo release_memory: a zeroed pool of the same shapes, fresh packed copies of the
        model's weights as they are now, the kernels' scratch reserved again."""
        if kv and self._slept_shapes:
            for t, shape in self._slept_shapes:
                t.set_(host_zeros(shape, t.dtype) if t.device.type == "cpu" else
                       torch.zeros(shape, dtype=t.dtype, device=t.device))
            self._slept_shapes = []
            if graphs_enabled(self.cuda_graphs, self.device) and self.chunk_size is None \
                    and not self.state_layers:
                max_blocks = min(self.k_caches[0].shape[0],
                                 -(-self.max_positions // self.block_size))
                self.graphs = decode_graph_runner(self, self._max_num_seqs, max_blocks)
        if weights and self._weights_released:
            self._weights_released = False
            self.refresh_weights()     # repacks (rebuilds, if a submodule was replaced asleep)
            self.head, self._decoder = self._choose_head(self._greedy_mode)
            if self._workspace_step is not None:
                self.reserve_workspace(*self._workspace_step)

    def refresh_weights(self) -> None:
        """Repack every packed copy now (after writes torch's version counter misses, e.g.
        through `.data`); copies are otherwise refreshed when a weight changes through torch.
        A submodule replaced since the build (the packed groups and the fused layers hold the
        modules) rebuilds those paths from the modules as they are now."""
        if self._weights_released:
            return              # rebuilt from the weights of the moment at wake_up
        modules = list(self.model.modules())
        if len(modules) != len(self._modules) or \
                any(a is not b for a, b in zip(modules, self._modules)):
            self._build_weight_paths()
            return
        if self.packed is not None:
            self.packed.refresh(force=True)
        head = getattr(self.head, "greedy", None)
        if head is not None:
            head.refresh(force=True)
