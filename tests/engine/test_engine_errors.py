"""Bad input gets a clear error for that request only; a failing step fails only its requests."""
import pytest

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import ATTN_BACKEND, fail_nth_model_run, make_model, random_prompts, reference_tokens, run_checked

pytestmark = pytest.mark.one_thread


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", max_position_embeddings=96)


@pytest.fixture()
def engine(llama):
    return Engine(llama, EngineConfig(block_size=8, num_blocks=10, max_batch_tokens=32,
                                      attention_backend=ATTN_BACKEND))


@pytest.mark.parametrize("prompt, params, exc, match", [
    ([], None, ValueError, "prompt is empty"),
    ([1, 2, 500], None, ValueError, r"prompt\[2\] = 500 is outside the vocabulary \[0, 500\)"),
    ([-1], None, ValueError, "outside the vocabulary"),
    ([1, 2.0], None, TypeError, r"prompt\[1\] must be an int"),
    ("text", None, TypeError, "no tokenizer"),
    ([[1, 2]], None, TypeError, r"prompt\[0\] must be an int"),
    (list(range(1, 98)), SamplingParams(max_new_tokens=1), ValueError,
     "97 tokens, more than the model's max_position_embeddings \\(96\\)"),
    (list(range(1, 80)), SamplingParams(max_new_tokens=40), ValueError,
     r"needs 118 positions, more than the model's max_position_embeddings \(96\)"),
    (list(range(1, 60)), SamplingParams(max_new_tokens=30), ValueError,
     r"prompt \(59 tokens\) \+ max_new_tokens \(30\) needs 11 blocks of 8 tokens, the pool has "
     r"10 blocks \(80 tokens\)"),
    ([1, 2], "greedy", TypeError, "params must be a SamplingParams"),
], ids=["empty", "vocab", "negative", "float-id", "str-without-tokenizer", "nested",
        "over-max-positions", "prompt-plus-new-over-positions", "never-fits-pool", "params-type"])
def test_bad_request_rejected_and_others_finish(engine, llama, prompt, params, exc, match):
    good = random_prompts([7, 20], seed=3)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6)) for p in good]
    with pytest.raises(exc, match=match):
        engine.add_request(prompt, params)
    outs = run_checked(engine)
    assert [outs[i].token_ids for i in ids] == reference_tokens(llama, good, 6)
    assert engine.stats()["used_blocks"] == 0


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, ValueError, "top_k must be >= 0"),
    ({"seed": "x"}, TypeError, "seed must be an int"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a sequence"),
    ({"stop_token_ids": [1, -3]}, ValueError, r"stop_token_ids\[i\] must be >= 0"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool"),
], ids=lambda v: str(v)[:30])
def test_wrong_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"block_size": 12}, ValueError, "block_size must be a power of two"),
    ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1"),
    ({"max_batch_tokens": 8, "max_num_seqs": 16}, ValueError, "max_num_seqs .16. must be <="),
    ({"preemption": "drop"}, ValueError, "preemption must be one of"),
    ({"overlap": True}, ValueError, "overlap must be one of"),
    ({"attention_backend": "flash"}, ValueError, "attention_backend must be one of"),
    ({"dtype": "float64"}, ValueError, "dtype must be one of"),
    ({"cpu_offload_gib": -1}, ValueError, "cpu_offload_gib must be >= 0"),
    ({"prefix_caching": "yes"}, TypeError, "prefix_caching must be a bool"),
], ids=lambda v: str(v)[:30])
def test_wrong_engine_config(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EngineConfig(**kwargs)


def test_generate_returns_an_error_output_for_each_bad_prompt(engine, llama):
    good = random_prompts([9, 3], seed=4)
    outs = engine.generate([good[0], [], [1, 999], good[1]], SamplingParams(max_new_tokens=5))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "prompt is empty" in outs[1].error and "outside the vocabulary" in outs[2].error
    assert [outs[0].token_ids, outs[3].token_ids] == reference_tokens(llama, good, 5)


def test_cancel_unknown_request(engine):
    with pytest.raises(ValueError, match="'nope' is not waiting or running"):
        engine.cancel("nope")
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    engine.cancel(rid)
    assert engine.step()[0].finish_reason == "cancelled"
    with pytest.raises(ValueError, match="not waiting or running"):
        engine.cancel(rid)
    engine.add_request([1], request_id="dup")
    with pytest.raises(ValueError, match="'dup' is already waiting or running"):
        engine.add_request([2], request_id="dup")


def test_exception_inside_a_step_fails_that_step_only(engine, llama, monkeypatch):
    prompts = random_prompts([5, 6, 7], seed=5)
    fail_nth_model_run(monkeypatch, engine.runner, 3)
    first = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    assert engine.step() == [] and engine.step() == []      # prefill, first decode
    ended = engine.step()                                   # the injected failure
    assert sorted(o.request_id for o in ended) == sorted(first)
    assert all(o.finish_reason == "error" and "injected kernel failure" in o.error
               for o in ended)
    engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0 and not engine.has_unfinished()
    later = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8))
    outs = run_checked(engine)
    assert outs[later].token_ids == reference_tokens(llama, prompts[:1], 8)[0]
    assert engine.stats()["failed_steps"] == 1
