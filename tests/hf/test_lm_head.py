"""The packed LM head (cb_kernels/hf/lm_head.py): when it applies, and that its logits are the
model's."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cb_kernels.hf.lm_head import PackedHead, _supported

pytestmark = pytest.mark.skipif(not _supported(), reason="torch without oneDNN linear ops")


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval().to(dtype)


def test_builds_only_for_cpu_fp32_plain_heads():
    assert PackedHead.build(_llama()) is not None
    assert PackedHead.build(_llama(torch.bfloat16)) is None
    gemma_like = _llama()
    gemma_like.config.model_type = "gemma2"      # softcapped logits: keep model.forward
    assert PackedHead.build(gemma_like) is None


@pytest.mark.one_thread
def test_logits_match_model_and_follow_weight_changes():
    model = _llama()
    head = PackedHead.build(model)
    ids = torch.randint(0, 500, (1, 9))
    pos = torch.arange(9)[None]
    keep = torch.tensor([2, 8])
    with torch.inference_mode():
        want = model(input_ids=ids, position_ids=pos).logits[0, keep]
        torch.testing.assert_close(head(ids, pos, keep), want, rtol=1e-5, atol=1e-5)
        model.lm_head.weight.mul_(2)       # an in-place change must repack
        want = model(input_ids=ids, position_ids=pos).logits[0, keep]
        torch.testing.assert_close(head(ids, pos, keep), want, rtol=1e-5, atol=1e-5)
