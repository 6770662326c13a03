"""Pure-torch references of every op (`ref_<op>`): slow, obviously right, and the tests' oracle."""
from __future__ import annotations

import math

import torch


def ref_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, *, scale: float | None = None,
                        sliding_window: int | None = None,
                        softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of varlen queries over a paged KV cache, one sequence at a time, fp32 math.

    q:            [num_tokens, num_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache the same)
    block_tables: int [num_seqs, max_blocks_per_seq]; seq_lens: int [num_seqs] (KV length,
    new tokens included); cu_seqlens_q: int [num_seqs + 1]. The q tokens of sequence i are its
    last q_len positions. sinks: fp32 [num_heads] or None, one extra logit per head in every
    softmax (after scale and softcap) whose value row is zero (gpt-oss' attention sinks).
    Returns [num_tokens, num_heads, head_dim] in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for i in range(block_tables.shape[0]):
        q_start, q_end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seq_len, q_len = int(seq_lens[i]), q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[i, :math.ceil(seq_len / block_size)].long()
        # Whole blocks are gathered, then cut to seq_len: slots past it (maybe NaN) never enter.
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


def ref_write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter each token's K/V into its cache slot; slot -1 skips the token.

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (written in place); slot_mapping: int64 [num_tokens], slot =
    block_id * block_size + offset.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def ref_copy_blocks(k_caches, v_caches, block_mapping) -> None:
    """Copy block src to block dst in every layer's K and V cache, for each (src, dst) pair.

    k_caches, v_caches: lists over layers of [num_blocks, ...]; block_mapping: int64 [n, 2].
    """
    ref_swap_blocks(list(k_caches) + list(v_caches), list(k_caches) + list(v_caches), block_mapping)


def ref_swap_blocks(src_caches, dst_caches, block_mapping) -> None:
    """dst_caches[i][dst] = src_caches[i][src] for each (src, dst) pair and every i.

    src_caches, dst_caches: equal-length lists of [num_blocks, ...] (block counts may differ);
    block_mapping: int64 [n, 2]. Copies go one block at a time so no pair reads another's output
    through a temporary, whatever device each side is on.
    """
    for src, dst in block_mapping.tolist():
        for s, d in zip(src_caches, dst_caches):
            d[dst].copy_(s[src])


def ref_greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits: [num_rows, vocab_size]. Returns int64 [num_rows]: the first index of each row's
    largest value, a NaN counting as largest (torch.argmax's rule)."""
    return logits.argmax(dim=-1)



def ref_sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature=None) -> tuple:
    """logits: fp32 [num_rows, num_cols]; u: fp32 [num_rows] in (0, 1); temperature: fp32
    [num_rows] or None. Returns (int64 tokens, fp32 logprobs, fp32 lse) [num_rows] each: with
    y = (logits - row max) / temperature, the first column whose running fp32 sum of exp(y)
    passes u * the row's sum (the argmax if rounding lands past the last column of mass),
    y[token] - logsumexp(y), logsumexp(y). A row holding NaN or +inf (or only -inf): its argmax
    (torch's rule: the first NaN, else the first maximum), NaN logprob and lse."""
    top = logits.amax(-1, keepdim=True)
    y = logits - top
    if temperature is not None:
        y = y / temperature[:, None]
    bad = logits.isnan().any(-1) | top[:, 0].isinf()
    logp = y.log_softmax(-1)
    mass = y.exp()
    cum = mass.cumsum(-1)
    tokens = torch.searchsorted(cum, u[:, None] * cum[:, -1:], right=True)
    tokens = tokens.clamp_(max=y.shape[1] - 1)
    empty = mass.gather(1, tokens) <= 0
    tokens = torch.where(empty, mass.argmax(-1, keepdim=True), tokens)[:, 0]
    tokens = torch.where(bad, logits.argmax(-1), tokens)
    nan = torch.full_like(u, float("nan"))
    logprobs = torch.where(bad, nan, logp.gather(1, tokens[:, None])[:, 0])
    lse = torch.where(bad, nan, torch.logsumexp(y, -1))
    return tokens, logprobs, lse

def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., dim] (x += residual in place first when residual, like x, is given); weight: [dim].
    Returns weight * x / sqrt(mean(x^2, -1) + eps), a new tensor like x: the norm in fp32, cast
    to x's dtype before the weight multiplies it (transformers' LlamaRMSNorm)."""
    if residual is not None:
        x.add_(residual)
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_gated_rms_norm(x, gate, weight, eps: float, *, group_size: int,
                       norm_before_gate: bool = True) -> torch.Tensor:
    """x, gate: [..., dim]; weight: [group_size] or [dim]. transformers' Qwen3NextRMSNormGated
    (norm_before_gate) or MambaRMSNormGated (the gate first) per group of group_size, op for op."""
    dt, shape = x.dtype, x.shape
    w = weight if weight.shape[0] == shape[-1] else weight.repeat(shape[-1] // group_size)
    silu_gate = torch.nn.functional.silu(gate.float())
    h = x.float() if norm_before_gate else x.float() * silu_gate
    g = h.reshape(*shape[:-1], -1, group_size)
    h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(shape)
    if norm_before_gate:
        return ((w * h.to(dt)) * silu_gate).to(dt)
    return w * h.to(dt)


def ref_offset_rms_norm(x, weight, eps: float, residual=None) -> torch.Tensor:
    """x, residual: [..., dim]; weight: [dim]. transformers' Qwen3NextRMSNorm after the residual
    add (`residual + h` in x's dtype), op for op; x is updated in place when a residual is given."""
    if residual is not None:
        x.copy_(x + residual)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def ref_moe_route(router_logits, top_k: int, renormalize: bool = True) -> tuple:
    """router_logits: [num_tokens, num_experts]. transformers' Qwen3NextTopKRouter after its
    logits, op for op: (top-k weights in the logits' dtype, as float32; int64 expert ids)."""
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    value, index = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        value /= value.sum(dim=-1, keepdim=True)
    return value.to(router_logits.dtype).float(), index


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * dim], gate then up. Returns [..., dim] = silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def ref_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim], rotated in place and returned; cos, sin:
    [num_tokens, head_dim]. x = x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * cos[:, None] + rotated * sin[:, None])
    return x


def ref_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., k]; weight: [n, k]; bias: [n] or None. Returns [..., n] = x @ weight.T + bias in
    x's dtype, computed in float64 (the op's fp32 result is within fp32 rounding of it)."""
    y = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return y.to(x.dtype)


def ref_greedy_head(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden_states: [num_rows, hidden]; weight: [vocab, hidden]. Returns int64 [num_rows]: the
    argmax of the logits hidden_states @ weight.T computed in float64 (exact enough to order
    near-ties fp32 cannot), the lowest index on a tie."""
    return (hidden_states.double() @ weight.double().t()).argmax(dim=-1)


def ref_rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """ref_rope_ of q and of k in place, then ref_write_kv of the rotated k and of v."""
    ref_rope_(q, cos, sin)
    ref_rope_(k, cos, sin)
    ref_write_kv(k, v, k_cache, v_cache, slot_mapping)


def ref_fused_decoder(x, cos, sin, layers, final_norm, slot_mapping, block_tables, seq_lens,
                      cu_seqlens_q, k_caches, v_caches, *, heads: int, kv_heads: int,
                      head_dim: int, eps: float, scale: float) -> torch.Tensor:
    """The decoder stack FusedDecoder runs, as the loop of the references above in its order.

    x: [num_tokens, hidden], updated in place to the residual stream; cos, sin: [num_tokens,
    head_dim]; layers[i] = (in_norm weight [hidden], post_norm weight [hidden], (qkv weight
    [(heads + 2 kv_heads) head_dim, hidden], bias or None), (o weight [hidden, heads head_dim],
    bias), (gate_up weight [2 intermediate, hidden]: gate rows then up rows, bias), (down weight
    [hidden, intermediate], bias), sliding window or None); final_norm: [hidden]; slot_mapping
    and the caches (one k and v per layer, written) as ref_rope_write_kv_ takes them,
    block_tables, seq_lens, cu_seqlens_q as ref_paged_attention. Returns [num_tokens, hidden]:
    final_norm of the residual stream after the last layer.
    """
    t, q_n, kv_n = x.shape[0], heads * head_dim, kv_heads * head_dim
    pending = None          # the last sublayer's output, added into x by the next norm
    for (in_w, post_w, qkv, o, gate_up, down, window), k_cache, v_cache in \
            zip(layers, k_caches, v_caches):
        h = ref_rms_norm(x, in_w, eps, pending)
        q, k, v = ref_linear(h, *qkv).split([q_n, kv_n, kv_n], dim=-1)
        q, k, v = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), \
            v.view(t, kv_heads, head_dim)
        ref_rope_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        attn = ref_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   scale=scale, sliding_window=window)
        h = ref_rms_norm(x, post_w, eps, ref_linear(attn.view(t, q_n), *o))
        pending = ref_linear(ref_silu_mul(ref_linear(h, *gate_up)), *down)
    return ref_rms_norm(x, final_norm, eps, pending)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def ref_gated_delta_rule(q, k, v, g, beta, state, slots, cu_seqlens, has_state, *,
                         scale: float | None = None, l2norm_qk: bool = True) -> torch.Tensor:
    """q, k: [num_tokens, num_k_heads, k_dim]; v: [num_tokens, num_v_heads, v_dim]; g, beta: fp32
    [num_tokens, num_v_heads]; state: fp32 [num_slots, num_v_heads, k_dim, v_dim], updated in
    place; slots: int64 [num_seqs]; cu_seqlens: int32 [num_seqs + 1]; has_state: bool [num_seqs].
    Returns [num_tokens, num_v_heads, v_dim] in v's dtype: each row's tokens one at a time through
    transformers' torch_recurrent_gated_delta_rule recurrence (fp32 math), from its slot's state
    when has_state, else zeros; the final state back into the slot."""
    num_v_heads, k_dim = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    scale = k_dim ** -0.5 if scale is None else scale
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    if l2norm_qk:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    vf = v.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        s = state[slot].clone() if bool(has_state[i]) else torch.zeros_like(state[slot])
        for t in range(cu[i], cu[i + 1]):
            s = s * g[t].exp()[:, None, None]
            kv_mem = (s * kf[t][:, :, None]).sum(dim=-2)
            delta = (vf[t] - kv_mem) * beta[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = (s * qf[t][:, :, None]).sum(dim=-2)
        state[slot] = s
    return out.to(v.dtype)


def ref_causal_conv1d(x, weight, bias, conv_state, slots, cu_seqlens, has_state, *,
                      activation: str | None = "silu") -> torch.Tensor:
    """x: [num_tokens, channels]; weight: [channels, width]; bias: [channels] or None;
    conv_state: [num_slots, channels, state_len] (state_len >= width - 1), updated in place;
    slots: int64 [num_seqs]; cu_seqlens: int32 [num_seqs + 1]; has_state: bool [num_seqs].
    Returns [num_tokens, channels] in x's dtype: per row, a depthwise causal conv (torch's conv1d
    in x's dtype, then the activation, transformers' causal_conv1d_update) of its tokens preceded
    by the slot's window (zeros when not has_state); the slot then holds the row's last
    state_len inputs."""
    width, state_len = weight.shape[1], conv_state.shape[2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        rows = x[cu[i]:cu[i + 1]].t()                                  # [channels, n]
        window = conv_state[slot] if bool(has_state[i]) else torch.zeros_like(conv_state[slot])
        full = torch.cat([window, rows], dim=-1)                       # [channels, L + n]
        conv_state[slot] = full[:, full.shape[1] - state_len:]
        if rows.shape[1] == 0:
            continue
        y = torch.nn.functional.conv1d(full[None, :, state_len - width + 1:], weight[:, None],
                                       bias, groups=weight.shape[0])[0]
        if activation == "silu":
            y = torch.nn.functional.silu(y)
        out[cu[i]:cu[i + 1]] = y.t()
    return out


def ref_selective_scan(x, dt, A, B, C, state, slots, cu_seqlens, has_state, *, D=None,
                       dt_bias=None, dt_softplus: bool = True,
                       dt_limit: tuple = (0.0, float("inf"))) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; dt: fp32 [num_tokens, num_heads]; A, D, dt_bias: fp32
    [num_heads] (D, dt_bias may be None); B, C: [num_tokens, num_groups, d_state]; state: fp32
    [num_slots, num_heads, head_dim, d_state], updated in place; slots, cu_seqlens, has_state as
    ref_gated_delta_rule's. Returns [num_tokens, num_heads, head_dim] in x's dtype: each row's
    tokens one at a time through transformers' mamba2_selective_state_update recurrence (fp32)."""
    group = x.shape[1] // B.shape[1]
    xf = x.float()
    Bf = B.float().repeat_interleave(group, dim=1)
    Cf = C.float().repeat_interleave(group, dim=1)
    d = dt + (dt_bias if dt_bias is not None else 0.0)
    if dt_softplus:
        d = torch.nn.functional.softplus(d)
    d = d.clamp(dt_limit[0], dt_limit[1])
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    cu = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        s = state[slot].clone() if bool(has_state[i]) else torch.zeros_like(state[slot])
        for t in range(cu[i], cu[i + 1]):
            decay = torch.exp(d[t] * A)[:, None, None]
            s = s * decay + (d[t][:, None] * xf[t])[:, :, None] * Bf[t][:, None, :]
            out[t] = (s * Cf[t][:, None, :]).sum(-1)
            if D is not None:
                out[t] += D[:, None] * xf[t]
        state[slot] = s
    return out.to(x.dtype)


def ref_moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """hidden_states: [num_tokens, hidden]; top_k_index: int64 [num_tokens, top_k]; top_k_weights:
    [num_tokens, top_k]; gate_up_proj: [num_experts, 2 * inter, hidden] (gate rows, then up
    rows); down_proj: [num_experts, hidden, inter]. Returns [num_tokens, hidden]: transformers'
    experts forward (`grouped_mm_experts_forward`, silu gate): per (token, k) pair
    d = down(silu(gate(x)) * up(x)), each step rounded to x's dtype, then round(d * w) summed over
    k in fp32 and rounded once. The GEMMs run in float64 (the op's sums are within fp32 rounding)."""
    dt = hidden_states.dtype
    num_tokens, top_k = top_k_index.shape
    out = torch.zeros(num_tokens, top_k, hidden_states.shape[-1], dtype=torch.float32)
    for t in range(num_tokens):
        x = hidden_states[t].double()
        for k in range(top_k):
            e = int(top_k_index[t, k])
            gate, up = (gate_up_proj[e].double() @ x).to(dt).chunk(2)
            h = (torch.nn.functional.silu(gate.float()).to(dt).float() * up.float()).to(dt)
            d = (down_proj[e].double() @ h.double()).to(dt)
            out[t, k] = (d.float() * float(top_k_weights[t, k])).to(dt).float()
    return out.sum(dim=1).to(dt)


def ref_moe_block(x, shared=None, shared_gate=None, router=None, top_k=None, renormalize=True,
                  experts=None):
    """x: [num_tokens, hidden]; shared: (gate_up [2 * inter, hidden], down [hidden, inter]) or
    None; shared_gate: [1, hidden] or None; router: [num_experts, hidden] or None; experts:
    (gate_up_proj, down_proj) as ref_moe_experts. Returns [num_tokens, hidden]: Qwen3-Next's
    sparse MoE block (routed + sigmoid(x shared_gate^T) * shared(x)), or the dense MLP without
    a router, each op rounded to x's dtype as transformers' modules round it; the linears as
    ref_linear (float64)."""
    out = None
    if shared is not None:
        out = ref_linear(ref_silu_mul(ref_linear(x, shared[0])), shared[1])
    if router is None:
        return out
    weights, ids = ref_moe_route(ref_linear(x, router), top_k, renormalize)
    routed = ref_moe_experts(x, ids, weights, *experts)
    if out is None:
        return routed
    if shared_gate is not None:
        out = torch.sigmoid(ref_linear(x, shared_gate)) * out
    return routed + out
