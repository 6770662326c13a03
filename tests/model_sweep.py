"""Tiny random models of every causal-LM type transformers ships, and the check each one passes.

`tiny_model(model_type)` builds the type's config class with small sizes (only the fields the
class has) and the auto class transformers maps it to; `check(model_type)` runs three short
prompts through an Engine and through `model.generate` (greedy, fp32) and says how it went:
  "same"      the engine's tokens equal generate's
  "refused"   Engine() raised UnsupportedModelError (detail: its message)
  "wrong"     the engine ran and gave other tokens
  "step"      Engine() accepted the model and a step then failed (detail: the error)
  "build"     transformers itself could not build or run the tiny model (detail: the error)
"""
from __future__ import annotations

import dataclasses

import torch

VOCAB = 128
# Small sizes for every field name the config classes use for them. A name a class does not
# have is left out, so one table serves every family.
_SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    moe_num_experts=4, moe_k=2, moe_topk=2, num_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, moe_layer_freq=1, decoder_sparse_step=1, expert_interval=1,
    # latent attention (MLA): K head 8 + 8, V head 8 (different from K on purpose)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    # windows and chunks short enough that the prompts cross them
    sliding_window=5, attention_chunk_size=8,
    # SSM / linear attention / conv sizes
    state_size=8, ssm_state_size=8, mamba_d_state=8, mamba_n_heads=8, mamba_d_head=8,
    mamba_headdim=8, mamba_d_conv=4, mamba_expand=2, linear_num_key_heads=2,
    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    # the decoder of encoder-decoder families (their *ForCausalLM runs it alone)
    decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
    decoder_ffn_dim=48, encoder_ffn_dim=48,
    # embedding / misc sizes
    n_positions=256, n_ctx=256, rotary_dim=4, partial_rotary_factor=0.5,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, altup_num_inputs=2,
    laurel_rank=4, num_kv_shared_layers=0, global_head_dim=16, index_head_dim=8,
    index_n_heads=2, index_topk=4,
)
# Per type: what the shared table cannot express (other field names, validators' rules).
_EXTRA = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=5),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=48)),
    "zaya": dict(num_experts_per_tok=1),
    "mamba2": dict(num_heads=8, head_dim=8),
    "falcon_h1": dict(mamba_d_ssm=64),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "gemma4_unified_assistant": dict(hidden_size_per_layer_input=0),
    "xlnet": dict(d_head=8),
    "reformer": dict(is_decoder=True),
    "whisper": dict(encoder_attention_heads=4, decoder_attention_heads=4),
    "plbart": dict(encoder_attention_heads=4, decoder_attention_heads=4),
    "zamba": dict(num_hidden_layers=3),
    # two recurrent blocks and one attention block (transformers' forward with a cache needs one)
    "recurrent_gemma": dict(num_hidden_layers=3, attention_window_size=5),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    # the default 2-layer pattern would hold no convolution layer
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # hybrids: one stateful and one attention layer (an all-stateful 2-layer default fails in
    # transformers' own forward with a cache: get_seq_length needs an attention layer)
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"]),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
}
# Encoder families and encoder-decoder decoders whose *ForCausalLM class is meant to run as a
# causal decoder (transformers warns when it is not): built that way. Built as encoders they are
# refused (bidirectional attention; tests/runner/test_model_support.py checks that).
_AS_DECODER = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
               "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
               "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod", "bart", "bigbird_pegasus",
               "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
               "prophetnet", "trocr", "whisper"}
for _t in _AS_DECODER:
    _EXTRA.setdefault(_t, {}).update(is_decoder=True, is_encoder_decoder=False)
# Special token ids above the tiny vocabulary would index out of range.
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def _fields(cls) -> set:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}) or {})


def _small_kwargs(cls, extra: dict) -> dict:
    fields = _fields(cls)
    kwargs = {k: v for k, v in _SMALL.items() if k in fields}
    if "kv_lora_rank" in fields:             # latent attention expands K/V to every head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for name in _TOKEN_FIELDS:
        if name in fields:
            kwargs[name] = 0 if name == "pad_token_id" else 1
    kwargs.update({k: v for k, v in extra.items()})
    return kwargs


def tiny_config(model_type: str, **extra):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    extra = {**_EXTRA.get(model_type, {}), **extra}
    kwargs = _small_kwargs(cls, extra)
    subs = dict(getattr(cls, "sub_configs", None) or {})
    if not subs:
        return cls(**kwargs)
    defaults = cls()
    small_subs = {}
    for name in subs:
        sub = getattr(defaults, name, None)
        if name in extra or not dataclasses.is_dataclass(sub):
            continue
        small = _small_kwargs(type(sub), extra if name == "text_config" else {})
        if getattr(sub, "model_type", None):
            small["model_type"] = sub.model_type
        small_subs[name] = small
    try:
        # text, vision and audio towers alike: a default-sized tower takes seconds to build
        return cls(**kwargs, **small_subs)
    except Exception:                         # noqa: BLE001 (a tower's own size rules)
        text = {k: v for k, v in small_subs.items() if k == "text_config"}
        return cls(**kwargs, **text)


def tiny_model(model_type: str, seed: int = 0, **extra):
    """A random fp32 model of `model_type` with tiny sizes, eval mode, no EOS."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = None, 0
    # Logits processors of a generation config are not the engine's (BART-style configs force
    # EOS at max_length): the sweep compares the model's own greedy tokens.
    gen.forced_eos_token_id = gen.forced_bos_token_id = None
    return model


def prompts(seed: int = 0) -> list:
    """Three prompts; the longest crosses the tiny windows (5) and chunks (8)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]


@torch.inference_mode()
def generate_tokens(model, prompt_list, max_new_tokens):
    out = []
    for p in prompt_list:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def check(model_type: str, max_new_tokens: int = 4, **engine_kwargs):
    """(status, detail) for one model type; see the module docstring."""
    from cb_kernels import Engine, EngineConfig, SamplingParams, UnsupportedModelError

    ps = prompts()
    try:
        model = tiny_model(model_type)
    except Exception as e:                    # noqa: BLE001 (transformers' own failure)
        return "build", f"{type(e).__name__}: {e}"[:300]
    try:
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, **engine_kwargs))
    except UnsupportedModelError as e:
        return "refused", str(e)
    except Exception as e:                    # noqa: BLE001
        return "step", f"Engine(): {type(e).__name__}: {e}"[:300]
    try:
        want = generate_tokens(model, ps, max_new_tokens)
    except Exception as e:                    # noqa: BLE001 (transformers' own failure)
        return "build", f"generate: {type(e).__name__}: {e}"[:300]
    outs = engine.generate(ps, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    errors = [o.error for o in outs if o.error]
    if errors:
        return "step", errors[0][:300]
    engine.check_invariants()
    got = [o.token_ids for o in outs]
    return ("same", "") if got == want else ("wrong", f"{got} != {want}")
