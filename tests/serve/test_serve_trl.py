"""TRL's own vLLM client (`trl.generation.vllm_client.VLLMClient`, TRL 1.16) against a real
`cb-kernels serve --enable-rl-endpoints` process: what a GRPO trainer in server mode calls
(/health, /v1/models, /get_world_size, /v1/completions with token-id prompts, n and logprobs,
/reset_prefix_cache), then a weight push from a `save_pretrained` folder (/update_weights
{"weight_dir"}; TRL's own push is an NCCL broadcast, CUDA only) and greedy tokens equal to
transformers' with the pushed weights. Offline: tiny random models, a word tokenizer.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("CBK_REQUIRE_SERVE_TESTS"):     # .ci/run sets it: a missing extra fails there
    import fastapi, uvicorn  # noqa: E401, F401
else:
    for _name in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(_name, reason="needs the serve extra: pip install -e '.[serve]'")

from trl.generation import vllm_client  # noqa: E402  (the test extra)

from tests.helpers import make_tokenizer, reference_tokens  # noqa: E402
from tests.serve.test_serve_rl import Server, _model  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served, pushed = tmp_path_factory.mktemp("trl_model"), tmp_path_factory.mktemp("trl_push")
    _model(0).save_pretrained(served, safe_serialization=True)
    make_tokenizer().save_pretrained(served)
    _model(1).save_pretrained(pushed, safe_serialization=True)
    s = Server(served, tmp_path_factory.mktemp("trl_log") / "server.log", "--enable-rl-endpoints")
    yield s, pushed
    s.stop()


@pytest.fixture
def client(served, monkeypatch):
    # VLLMClient's constructor refuses unless the vllm package imports: it needs vLLM only for
    # its NCCL weight push (init_communicator), which this server replaces by a folder push.
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    c = vllm_client.VLLMClient(base_url=served[0].url, connection_timeout=30)
    yield c
    c.session.close()


def _forward_logprobs(model, prompt, completion) -> list:
    """log p(completion[t] | prompt + completion[:t]) from one transformers forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_vllm_client_generates_resets_and_follows_a_weight_push(served, client):
    server, pushed = served
    assert client.model == "tiny" and client.get_world_size() == 1
    # what GRPOTrainer sends in server mode: token ids, n, temperature 1, logprobs 0
    out = client.generate(PROMPTS, n=2, temperature=1.0, max_tokens=6, logprobs=0,
                          generation_kwargs={"seed": 3})
    assert out["prompt_ids"] == PROMPTS
    assert len(out["completion_ids"]) == 4 and all(len(c) == 6 for c in out["completion_ids"])
    assert out["completion_ids"][0] != out["completion_ids"][1]        # two samples, not one
    model = _model(0)
    for k, completion in enumerate(out["completion_ids"]):
        # one logprob per token (the sampled one's), its id as TRL parsed it from "token_id:N"
        assert [ids[0] for ids in out["logprob_token_ids"][k]] == completion
        got = [lps[0] for lps in out["logprobs"][k]]
        want = _forward_logprobs(model, PROMPTS[k // 2], completion)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)

    client.reset_prefix_cache()          # a bare POST, as TRL sends it

    greedy = client.generate(PROMPTS, temperature=0.0, max_tokens=6)["completion_ids"]
    assert greedy == reference_tokens(model, PROMPTS, 6)

    # the trainer saved its weights; the server loads them between two requests
    r = client.session.post(f"{client.base_url}/update_weights", json={"weight_dir": str(pushed)})
    assert r.status_code == 200 and r.json()["weight_version"] >= 1, r.text
    client.reset_prefix_cache()
    greedy = client.generate(PROMPTS, temperature=0.0, max_tokens=6)["completion_ids"]
    assert greedy == reference_tokens(_model(1), PROMPTS, 6)
    assert greedy != reference_tokens(model, PROMPTS, 6)
