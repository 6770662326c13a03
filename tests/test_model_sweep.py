"""The model sweep: every causal-LM type transformers ships, as a tiny random fp32 model (3 short
prompts, 4 greedy tokens), either gives `model.generate`'s tokens through the Engine or is refused
at Engine() with UnsupportedModelError naming the feature. Each type is listed with the status it
must have, so a transformers release that changes one fails here, and a type this table does not
list fails too (add it once its status is known). tests/model_sweep.py builds the models.

Statuses: SAME (the engine's tokens equal generate's), (REFUSED, words of the refusal),
(BUILD, words of transformers' own error: the tiny config does not build, nothing of ours runs).
Encoder models (bert, roberta, ...) and the decoders of encoder-decoder families (bart, whisper,
...) are in transformers' causal-LM mapping too and are built as causal decoders (is_decoder=True,
how their *ForCausalLM is meant to run): BERT-style ones run, and BART-style ones, which count
positions themselves, run with the step's positions handed to their positional embedding
(runner/positions.py). The model's generation config is generate's default except that
EOS is off (tests/model_sweep.py): logits processors a generation config may add
(forced_eos_token_id, bad_words_ids, ...) are not the engine's and are not compared here.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from model_sweep import check

SAME, REFUSED, BUILD = "same", "refused", "build"
# Types whose tiny model takes seconds to build or run on a 2-core CPU.
SLOW = {"blt"}

EXPECTED = {
    "afmoe": SAME,
    "apertus": SAME,
    "apertus1p5_text": SAME,
    "arcee": SAME,
    "aria_text": SAME,
    "axk1": SAME,
    "axk2": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "bailing_hybrid": SAME,
    "bamba": SAME,
    "bart": SAME,
    "beam": SAME,
    "bert": SAME,
    "bert-generation": SAME,
    "big_bird": (REFUSED, "does not attend through transformers' attention interface"),
    "bigbird_pegasus": (REFUSED, 'attends bidirectionally'),
    "biogpt": SAME,
    "bitnet": SAME,
    "blenderbot": SAME,
    "blenderbot-small": SAME,
    "bloom": (REFUSED, "does not attend through transformers' attention interface"),
    "blt": (REFUSED, 'has no num_attention_heads'),
    "camembert": SAME,
    "codegen": SAME,
    "cohere": SAME,
    "cohere2": SAME,
    "cohere2_moe": SAME,
    "cohere_compass_text": (BUILD, "KeyError: 'full_attention'"),
    "cpmant": (REFUSED, "does not attend through transformers' attention interface"),
    "ctrl": SAME,
    "cwm": SAME,
    "data2vec-text": SAME,
    "dbrx": SAME,
    "deepseek_v2": SAME,
    "deepseek_v3": SAME,
    "deepseek_v32": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "deepseek_v4": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "diffllama": (REFUSED, 'repeated layer indices'),
    "doge": (REFUSED, 'built or changed itself'),
    "dory": (REFUSED, 'repeated layer indices'),
    "dots1": SAME,
    "dots3_note": (BUILD, 'vision adapter output width'),
    "dots3_note_text": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "electra": SAME,
    "emu3": SAME,
    "ernie": SAME,
    "ernie4_5": SAME,
    "ernie4_5_moe": SAME,
    "exaone": SAME,
    "exaone4": SAME,
    "exaone_moe": SAME,
    "falcon": (REFUSED, "does not attend through transformers' attention interface"),
    "falcon_h1": SAME,
    "falcon_mamba": SAME,
    "flex_olmo": SAME,
    "flint": SAME,
    "fuyu": SAME,
    "gemma": SAME,
    "gemma2": SAME,
    "gemma3": SAME,
    "gemma3_text": SAME,
    "gemma3n": (BUILD, 'requires the timm library'),
    "gemma3n_text": SAME,
    "gemma4": SAME,
    "gemma4_assistant": (BUILD, 'hidden_size_per_layer_input must be 0'),
    "gemma4_text": SAME,
    "gemma4_unified": SAME,
    "gemma4_unified_assistant": (REFUSED, "forward fails under cb_kernels' attention"),
    "gemma4_unified_text": SAME,
    "git": (REFUSED, "does not attend through transformers' attention interface"),
    "glm": SAME,
    "glm4": SAME,
    "glm4_moe": SAME,
    "glm4_moe_lite": SAME,
    "glm_moe_dsa": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "got_ocr2": SAME,
    "gpt-sw3": SAME,
    "gpt2": SAME,
    "gpt_bigcode": SAME,
    "gpt_neo": (REFUSED, "does not attend through transformers' attention interface"),
    "gpt_neox": SAME,
    "gpt_neox_japanese": (REFUSED, "does not attend through transformers' attention interface"),
    "gpt_oss": SAME,
    "gptj": SAME,
    "granite": SAME,
    "granite_swa": SAME,
    "granitemoe": SAME,
    "granitemoe_swa": SAME,
    "granitemoehybrid": SAME,
    "granitemoeshared": SAME,
    "helium": SAME,
    "hrm_text": (REFUSED, 'repeated layer indices'),
    "hunyuan_v1_dense": SAME,
    "hunyuan_v1_moe": SAME,
    "hy_v3": SAME,
    "hy_v4": (REFUSED, "(config.layer_types) that cb_kernels does not run"),
    "hyperclovax": SAME,
    "inkling2_loop_text": (REFUSED, "passes ['position_bias'"),
    "inkling2_text": (REFUSED, "passes ['position_bias'"),
    "inkling_text": (REFUSED, "passes ['position_bias'"),
    "internlm3": SAME,
    "iquestcoder": SAME,
    "jais2": SAME,
    "jamba": SAME,
    "jetmoe": SAME,
    "kimi_linear": SAME,
    "kolibri1": SAME,
    "laguna": SAME,
    "lara_mini": SAME,
    "lfm2": SAME,
    "lfm2_moe": SAME,
    "lfm3": SAME,
    "llama": SAME,
    "llama4": SAME,
    "llama4_text": SAME,
    "longcat_flash": SAME,
    "mamba": SAME,
    "mamba2": SAME,
    "marian": SAME,
    "mbart": SAME,
    "megatron-bert": (REFUSED, "does not attend through transformers' attention interface"),
    "mellum": SAME,
    "mimo_v2_flash": SAME,
    "minicpm3": SAME,
    "minimax": SAME,
    "minimax_m2": SAME,
    "minimax_m3_vl_text": SAME,
    "ministral": SAME,
    "ministral3": SAME,
    "mistral": SAME,
    "mixtral": SAME,
    "mllama": SAME,
    "modernbert-decoder": SAME,
    "moshi": (REFUSED, 'cache keeps a window'),
    "moss_transcribe_diarize": SAME,
    "mpt": (REFUSED, "does not attend through transformers' attention interface"),
    "musicgen": (BUILD, "has no attribute 'dropout'"),
    "musicgen_melody": (BUILD, "has no attribute 'dropout'"),
    "mvp": (REFUSED, "does not attend through transformers' attention interface"),
    "nanochat": SAME,
    "nemotron": SAME,
    "nemotron_h": SAME,
    "olmo": SAME,
    "olmo2": SAME,
    "olmo3": SAME,
    "olmo_hybrid": SAME,
    "olmoe": SAME,
    "openai-gpt": (REFUSED, "does not attend through transformers' attention interface"),
    "opt": SAME,
    "pegasus": SAME,
    "persimmon": SAME,
    "phi": SAME,
    "phi3": SAME,
    "phi4_multimodal": SAME,
    "phimoe": SAME,
    "plbart": SAME,
    "prophetnet": (REFUSED, "does not attend through transformers' attention interface"),
    "qwen2": SAME,
    "qwen2_moe": SAME,
    "qwen3": SAME,
    "qwen3_5": SAME,
    "qwen3_5_moe": SAME,
    "qwen3_5_moe_text": SAME,
    "qwen3_5_text": SAME,
    "qwen3_moe": SAME,
    "qwen3_next": SAME,
    "qwen4_exp": (REFUSED, "could not be read off transformers' cache"),
    "qwen4_exp_text": (REFUSED, "could not be read off transformers' cache"),
    "recurrent_gemma": SAME,
    "reformer": (BUILD, 'axial_pos_embds'),
    "rembert": (REFUSED, "does not attend through transformers' attention interface"),
    "roberta": SAME,
    "roberta-prelayernorm": SAME,
    "roc_bert": SAME,
    "roformer": (REFUSED, "does not attend through transformers' attention interface"),
    "rwkv": (REFUSED, 'has no num_attention_heads'),
    "sarvam_mla": SAME,
    "sarvam_moe": SAME,
    "seed_oss": SAME,
    "smollm3": SAME,
    "solar_open": SAME,
    "stablelm": SAME,
    "starcoder2": SAME,
    "trocr": (REFUSED, "does not attend through transformers' attention interface"),
    "vaultgemma": SAME,
    "whisper": SAME,
    "xglm": (REFUSED, "does not attend through transformers' attention interface"),
    "xlm": (REFUSED, "does not attend through transformers' attention interface"),
    "xlm-roberta": SAME,
    "xlm-roberta-xl": SAME,
    "xlnet": (REFUSED, "does not attend through transformers' attention interface"),
    "xlstm": (REFUSED, 'has no num_attention_heads'),
    "xmod": (REFUSED, "forward fails under cb_kernels' attention"),
    "youtu": SAME,
    "zamba": (BUILD, 'tie_weights_keys'),
    "zamba2": SAME,
    "zaya": (REFUSED, "forward fails under cb_kernels' attention"),
}

# transformers 5.17 (the oldest supported release, the GPU image's), where it differs from 5.24:
# CodeGen and GPT-J did not use the attention interface yet. Measured: the whole table passes
# under 5.17.0 (2026-12-04, the hybrids included; .ci/run runs the suite there too).
EXPECTED_5_17 = {
    "codegen": (REFUSED, "does not attend through transformers' attention interface"),
    "gptj": (REFUSED, "does not attend through transformers' attention interface"),
    "gemma4_assistant": (BUILD, "has no attribute 'vocab_size'"),
    "gemma4_unified_assistant": (BUILD, "has no attribute 'vocab_size'"),
    "musicgen": (BUILD, "Field 'text_encoder'"),
    "musicgen_melody": (BUILD, "Field 'text_encoder'"),
}


def _expected(model_type: str):
    import transformers

    if transformers.__version__.startswith("5.17."):
        return EXPECTED_5_17.get(model_type, EXPECTED.get(model_type))
    return EXPECTED.get(model_type)


def _all_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _params():
    for t in _all_types():
        marks = [pytest.mark.slow] if t in SLOW else []
        yield pytest.param(t, id=t, marks=marks)


@pytest.mark.one_thread
@pytest.mark.parametrize("model_type", list(_params()))
def test_model_type_has_its_status(model_type):
    want = _expected(model_type)
    assert want is not None, (f"{model_type!r} is new in this transformers: run "
                              "tests/model_sweep.check on it and add its status to EXPECTED")
    if model_type == "gemma3n" and importlib.util.find_spec("timm") is not None:
        pytest.skip("gemma3n builds its vision tower with timm; its status with timm installed "
                    "is not recorded")
    status, detail = check(model_type)
    if want == SAME:
        assert status == SAME, f"{model_type}: {status}: {detail}"
    else:
        kind, words = want
        assert status == kind and words in detail, f"{model_type}: {status}: {detail}"



def _same_types() -> list:
    return [t for t in _all_types() if _expected(t) == SAME]


@pytest.mark.slow
@pytest.mark.one_thread
@pytest.mark.parametrize("model_type", _same_types())
def test_model_type_longer_generation_with_prefix_caching_and_overlap(model_type):
    """The SAME types again over 16 new tokens with prefix caching and the overlap pipeline on
    (synchronous on CPU): still generate's tokens."""
    status, detail = check(model_type, max_new_tokens=16, prefix_caching=True, overlap="on")
    assert status == SAME, f"{model_type}: {status}: {detail}"
