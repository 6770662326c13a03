"""The sampling surface on a GPU: every feature in one batch on CUDA (the sampler's tensor work
on the device), logprobs against the model's own log-softmax, n samples reproducible run to run
and the same as on the CPU where the logits agree to fp32 rounding."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import make_model, random_prompts

pytestmark = pytest.mark.gpu


def features():
    return [SamplingParams(max_new_tokens=10, temperature=0.8, n=3, seed=3, logprobs=2),
            SamplingParams(max_new_tokens=10, repetition_penalty=1.4, prompt_logprobs=1),
            SamplingParams(max_new_tokens=10, temperature=1.1, top_k=40, top_p=0.9, min_p=0.02,
                           frequency_penalty=0.5, presence_penalty=0.3, seed=4, logprobs=0),
            SamplingParams(max_new_tokens=10, logit_bias={17: 3.0}, min_new_tokens=4),
            SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-300, seed=2 ** 64 - 1),
            SamplingParams(max_new_tokens=10)]


def run(model, prompts, **cfg):
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=64, **cfg))
    outs = engine.generate(prompts, features())
    assert engine.stats()["failed_steps"] == 0 and engine.stats()["used_blocks"] == 0
    engine.check_invariants()
    return outs


def test_all_features_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model("llama").cuda()
    prompts = random_prompts([23, 9, 31, 14, 27, 18], seed=12)
    a, b = run(model, prompts), run(model, prompts, overlap="on")
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]
    c = a[0].outputs[1]
    with torch.inference_mode():
        ref = model(torch.tensor([prompts[0] + c.token_ids[:-1]], device="cuda")).logits[0]
    ref = ref.float().log_softmax(-1)[len(prompts[0]) - 1:].cpu()
    got = torch.tensor([e[t] for e, t in zip(c.logprobs, c.token_ids)])
    assert torch.allclose(got, ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0], atol=1e-3)
    assert len(a[1].prompt_logprobs) == len(prompts[1])
    assert all(len(o.token_ids) == 10 for o in a[:4])
