"""The sampling surface (issue 15): logprobs and prompt logprobs against the model's own
log-softmax, penalties and filters against plain torch on the same logits, n samples sharing
their prompt's blocks, stop strings across token boundaries, every bad value, and all of it under
memory pressure with swap and recompute."""
import math

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.engine.sampler import change_logits, draw, filter_logits, uniforms
from cb_kernels.engine.sequence import Sequence
from tests.helpers import (ATTN_BACKEND, VOCAB, make_model, make_tokenizer, random_prompts,
                           reference_tokens, run_checked)

pytestmark = pytest.mark.one_thread
TOL = 1e-4          # fp32 logprobs: the engine's paged forward against the model's own


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def engine_for(model, tokenizer=None, **cfg):
    cfg.setdefault("block_size", 8)
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("attention_backend", ATTN_BACKEND)
    return Engine(model, EngineConfig(**cfg), tokenizer=tokenizer)


@torch.inference_mode()
def model_logprobs(model, ids):
    """log-softmax of the model's fp32 logits at every position of `ids`: [len(ids), vocab]."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


# -- bad values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"n": 0}, ValueError, "n must be >= 1"),
    ({"n": 2.0}, TypeError, "n must be an int"),
    ({"logprobs": -1}, ValueError, "logprobs must be >= 0"),
    ({"prompt_logprobs": -2}, ValueError, "prompt_logprobs must be >= 0"),
    ({"min_p": 1.5}, ValueError, r"min_p must be in \[0, 1\]"),
    ({"min_p": -0.1}, ValueError, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be > 0"),
    ({"repetition_penalty": float("nan")}, ValueError, "repetition_penalty must be finite"),
    ({"frequency_penalty": float("inf")}, ValueError, "frequency_penalty must be finite"),
    ({"presence_penalty": float("-inf")}, ValueError, "presence_penalty must be finite"),
    ({"logit_bias": {3: float("nan")}}, ValueError, r"logit_bias\[3\] must be finite"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias key must be >= 0"),
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias must be a dict"),
    ({"stop": ""}, ValueError, r"stop\[0\] is an empty string"),
    ({"stop": ["a", ""]}, ValueError, r"stop\[1\] is an empty string"),
    ({"stop": 5}, TypeError, "stop must be a str"),
    ({"stop": ["a", 3]}, TypeError, r"stop\[1\] must be a str"),
    ({"include_stop_str_in_output": 1}, TypeError, "include_stop_str_in_output must be a bool"),
    ({"min_new_tokens": -1}, ValueError, "min_new_tokens must be >= 0"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, ValueError, r"min_new_tokens \(9\) must be <="),
    ({"seed": 2 ** 64}, ValueError, r"seed must be < 2\*\*64"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"temperature": 1e-45}, ValueError, "temperature must be 0 .greedy. or >= 1e-05"),
    ({"temperature": 1e-6}, ValueError, "underflows"),
], ids=lambda v: str(v)[:32])
def test_bad_sampling_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("params, tokenizer, match", [
    (SamplingParams(logit_bias={VOCAB: 1.0}), False, r"logit_bias holds 500, outside the vocabulary \[0, 500\)"),
    (SamplingParams(stop_token_ids=[VOCAB + 3]), False, r"stop_token_ids holds 503, outside the vocabulary \[0, 500\)"),
    (SamplingParams(logprobs=VOCAB + 1), False, r"logprobs \(501\) must be <= the vocabulary"),
    (SamplingParams(stop=["w1"]), False, "stop strings need the Engine's tokenizer"),
], ids=["bias-id", "stop-id", "logprobs-k", "stop-without-tokenizer"])
def test_bad_values_at_add_request(llama, params, tokenizer, match):
    engine = engine_for(llama, make_tokenizer() if tokenizer else None)
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2, 3], params)
    mutated = SamplingParams(temperature=1.0)
    mutated.temperature = 1e-45            # changed after construction: add_request checks again
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2, 3], mutated)
    assert not engine.has_unfinished() and engine.stats()["used_blocks"] == 0


def test_extreme_accepted_values_never_fail_the_step(llama):
    """Issue 18 item 2: seed near 2**64, the smallest temperature, top_p=1e-300 and min_p=1 are
    sampled safely, in one step with greedy neighbours that keep their tokens."""
    prompts = random_prompts([9, 14, 5, 11, 7, 10], seed=4)
    params = [SamplingParams(max_new_tokens=6),
              SamplingParams(max_new_tokens=6, temperature=1.0, seed=2 ** 64 - 1),
              SamplingParams(max_new_tokens=6, temperature=1e-5, seed=1),
              SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-300, seed=2),
              SamplingParams(max_new_tokens=6, temperature=3.0, min_p=1.0, top_k=1_000_000,
                             frequency_penalty=-1e30, logit_bias={7: 1e30}, seed=3),
              SamplingParams(max_new_tokens=6, temperature=1.0, repetition_penalty=1e-30,
                             frequency_penalty=-3e38, presence_penalty=-3e38, seed=5,
                             logprobs=2)]
    engine = engine_for(llama)
    outs = engine.generate(prompts, params)
    assert engine.stats()["failed_steps"] == 0
    assert [o.finish_reason for o in outs] == ["length"] * 6
    ref = reference_tokens(llama, prompts, 6)
    assert outs[0].token_ids == ref[0]
    assert outs[2].token_ids == ref[2]           # temperature 1e-5: the argmax
    assert outs[3].token_ids == ref[3]           # top_p 1e-300 keeps only the top token
    assert outs[4].token_ids == [7] * 6          # a huge bias wins, min_p=1 keeps the top only
    # Penalties past fp32's range: every seen token saturates at the largest float and wins
    # (repetition_penalty covers the prompt), so every token is one of the prompt's.
    assert set(outs[5].token_ids) <= set(prompts[5])
    assert all(math.isfinite(lp) for e in outs[5].outputs[0].logprobs for lp in e.values())
    assert engine.stats()["used_blocks"] == 0


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models_log_softmax(llama, temperature):
    prompts = random_prompts([7, 19], seed=5)
    engine = engine_for(llama)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=9, logprobs=3)
    outs = engine.generate(prompts + [prompts[0]],
                           [params, params, SamplingParams(max_new_tokens=6)])
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 6
        ref = model_logprobs(llama, prompt + c.token_ids[:-1])[len(prompt) - 1:]
        for t, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            top = torch.topk(ref[t], 3)
            assert set(top.indices.tolist()) | {token} == set(entry)
            for tid, lp in entry.items():
                assert abs(lp - ref[t, tid].item()) < TOL
        chosen = [e[t] for e, t in zip(c.logprobs, c.token_ids)]
        assert math.isclose(c.cumulative_logprob, sum(chosen), abs_tol=1e-6)
        if temperature == 0:
            assert c.token_ids == reference_tokens(llama, [prompt], 6)[0]
    assert outs[2].outputs[0].logprobs is None and outs[2].outputs[0].cumulative_logprob is None


def test_logprobs_zero_holds_the_chosen_token_only(llama):
    out = engine_for(llama).generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, logprobs=0))[0]
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.token_ids]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])   # the fused forward; transformers'
def test_prompt_logprobs_every_position_despite_prefix_cache_and_chunks(llama, kind):
    if kind != "llama":
        llama = make_model(kind)
    prompt = random_prompts([37], seed=6)[0]
    ref = model_logprobs(llama, prompt)
    engine = engine_for(llama, max_batch_tokens=16)     # 37 tokens prefill in three chunks
    warm = engine.generate([prompt], SamplingParams(max_new_tokens=2))[0]   # caches 4 blocks
    assert engine.stats()["cached_blocks"] >= 4
    out = engine.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=2))[0]
    assert out.token_ids == warm.token_ids
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    for j in range(1, len(prompt)):
        top = torch.topk(ref[j - 1], 2).indices.tolist()
        assert set(top) | {prompt[j]} == set(pl[j])
        for tid, lp in pl[j].items():
            assert abs(lp - ref[j - 1, tid].item()) < TOL
    assert warm.prompt_logprobs is None
    assert engine.stats()["used_blocks"] == 0


# -- penalties and filters against plain torch ---------------------------------------------------
def fake_seq(prompt, output, **kw):
    seq = Sequence(0, "r", prompt, SamplingParams(max_new_tokens=20, **kw),
                   eos_token_ids=frozenset([5]))
    seq.token_ids += output
    return seq


def reference_change(logits, seq):
    """Plain torch, one row at a time, in the documented order."""
    p, x = seq.params, logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if seq.num_generated_tokens < p.min_new_tokens:
        for t in set(p.stop_token_ids) | ({5} if not p.ignore_eos else set()):
            x[t] = -float("inf")
    if p.repetition_penalty != 1:       # transformers' RepetitionPenaltyLogitsProcessor
        ids = torch.tensor(seq.token_ids)
        score = x.gather(0, ids)
        score = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        x = x.scatter(0, ids, score)
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64),
                            minlength=len(x)).float()
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_penalties_bias_and_min_new_tokens_match_plain_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    seqs = [fake_seq([1, 2, 2, 9], [3, 3, 4], repetition_penalty=1.7),
            fake_seq([7, 8], [8, 8, 8, 1], frequency_penalty=0.6, presence_penalty=-0.4),
            fake_seq([1, 5], [2], min_new_tokens=3, stop_token_ids=[11, 12], logit_bias={5: 9.0}),
            fake_seq([4], [4, 6], logit_bias={0: -2.5, 49: 1.5}, repetition_penalty=0.5,
                     frequency_penalty=0.3, min_new_tokens=2, ignore_eos=True),
            fake_seq([1, 2, 3], []),
            fake_seq([6], [6, 6], presence_penalty=2.0, min_new_tokens=2)]
    got = change_logits(logits.clone(), seqs)
    want = torch.stack([reference_change(logits[i], s) for i, s in enumerate(seqs)])
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def reference_filter(row, p):
    """Plain torch: temperature, min_p on probabilities, top-k, top-p (smallest prefix of the
    sorted tokens whose mass reaches top_p)."""
    y = row / p.temperature
    probs = y.softmax(-1)
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < len(row):
        keep &= y >= torch.topk(y, p.top_k).values[-1]
    y = y.masked_fill(~keep, -float("inf"))
    if p.top_p < 1:
        order = torch.argsort(y, descending=True)
        probs = y[order].softmax(-1)
        before = probs.cumsum(-1) - probs
        n = max(1, int((before < p.top_p).sum()))
        mask = torch.ones_like(keep)
        mask[order[:n]] = False
        y = y.masked_fill(mask & (y < y[order[n - 1]]), -float("inf"))
    return y


def test_min_p_top_k_top_p_and_draws_match_plain_torch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=g) * 2
    params = [SamplingParams(temperature=0.7, min_p=0.2), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.5),
              SamplingParams(temperature=2.0, top_k=12, top_p=0.9, min_p=0.05)]
    got = filter_logits(logits.clone(), params)
    for i, p in enumerate(params):
        want = reference_filter(logits[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        fin = ~torch.isinf(want)
        assert torch.allclose(got[i].softmax(-1)[fin], want.softmax(-1)[fin], atol=1e-6)
    # The draws follow the filtered distribution: 20k positions of one seed, row 2 (top_p).
    probs = got[2].softmax(-1)
    n = 20_000
    u = uniforms(torch.full((n,), 12345, dtype=torch.int64), torch.arange(n))
    tokens = draw(got[2:3].expand(n, -1).clone(), u)
    freq = torch.bincount(tokens, minlength=40).float() / n
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.015


def test_repetition_penalty_matches_model_generate(llama):
    prompts = random_prompts([6, 15], seed=7)
    prompts = [p + p[:4] for p in prompts]          # repeated tokens for the penalty to bite
    outs = engine_for(llama).generate(prompts, SamplingParams(max_new_tokens=12,
                                                              repetition_penalty=1.8))
    plain = reference_tokens(llama, prompts, 12)
    for p, out, free in zip(prompts, outs, plain):
        with torch.inference_mode():
            ref = llama.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, repetition_penalty=1.8)[0, len(p):].tolist()
        assert out.token_ids == ref
    assert [o.token_ids for o in outs] != plain        # the penalty changed something


# -- n samples -----------------------------------------------------------------------------------
def test_n_samples_share_blocks_reproducible_and_independent(llama):
    prompt = random_prompts([20], seed=8)[0]          # 3 blocks of 8, the last one partial
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=77, logprobs=1)
    engine = engine_for(llama, max_batch_tokens=64)
    rid = engine.add_request(prompt, params)
    engine.step()                                     # the prefill: 4 samples, one set of blocks
    assert engine.stats()["used_blocks"] == 3 and engine.stats()["running"] == 4
    engine.step()                                     # each sample writes its token: CoW copies
    assert engine.stats()["used_blocks"] == 3 + 3
    outs = run_checked(engine)
    out = outs[rid]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) == 4 and all(len(s) == 10 for s in samples)
    assert out.token_ids == samples[0] and out.finish_reason == "length"
    for c in out.outputs:
        ref = model_logprobs(llama, prompt + c.token_ids[:-1])[len(prompt) - 1:]
        got = torch.tensor([e[t] for e, t in zip(c.logprobs, c.token_ids)])
        assert torch.allclose(got, ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                              atol=TOL)
    assert engine.stats()["used_blocks"] == 0
    # Run to run, in a crowd of other requests, on a pool small enough to preempt: same samples.
    crowd = random_prompts([30, 25, 18], seed=9)
    for preemption in ("recompute", "swap"):
        busy = engine_for(llama, block_size=4, num_blocks=24, max_batch_tokens=32, max_num_seqs=5,
                          preemption=preemption, cpu_offload_gib=0.01)
        got = busy.generate([crowd[0], prompt, crowd[1], crowd[2]],
                            [SamplingParams(max_new_tokens=12, temperature=0.9, seed=1), params,
                             SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=12)])
        assert [c.token_ids for c in got[1].outputs] == samples, preemption
        assert busy.stats()["preemptions"] > 0
        assert busy.stats()["used_blocks"] == 0
        busy.check_invariants()


def test_n_samples_cancel_and_stream(llama):
    prompt = random_prompts([11], seed=10)[0]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=5)
    full = engine_for(llama).generate([prompt], params)[0]
    engine = engine_for(llama)
    got = {}
    for delta in engine.stream([prompt], params):
        c = delta.outputs[0]
        got.setdefault(c.index, []).extend(c.token_ids)
    assert [got[i] for i in range(3)] == [c.token_ids for c in full.outputs]
    rid = engine.add_request(prompt, params)
    engine.step()
    engine.step()
    engine.cancel(rid)
    outs = run_checked(engine)
    assert [c.finish_reason for c in outs[rid].outputs] == ["cancelled"] * 3
    assert engine.stats()["used_blocks"] == 0
    # Sample 0 stops first (a stop token of its own); the request still runs and can be
    # cancelled, and its id stays taken until the last sample ended.
    stop = full.outputs[0].token_ids[1]
    others = [c.token_ids for c in full.outputs[1:]]
    assert all(stop not in t[:3] for t in others), "pick another prompt for this check"
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, n=3,
                                                    seed=5, stop_token_ids=[stop]))
    for _ in range(3):
        engine.step()
    assert engine.sequence(rid) is None and engine.has_unfinished()
    with pytest.raises(ValueError, match="already waiting or running"):
        engine.add_request(prompt, params, request_id=rid)
    engine.cancel(rid)
    out = run_checked(engine)[rid]
    assert [c.finish_reason for c in out.outputs] == ["stop", "cancelled", "cancelled"]
    assert out.outputs[0].stop_reason == stop and out.outputs[1].token_ids == others[0][:3]
    assert engine.stats()["used_blocks"] == 0


# -- stop strings --------------------------------------------------------------------------------
def test_stop_strings_across_tokens_generate_and_stream(llama):
    tok = make_tokenizer()
    prompt = "w5 w17 w200 w3"
    engine = engine_for(llama, tok)
    free = engine.generate([prompt], SamplingParams(max_new_tokens=10))[0]
    words = free.text.split(" ")
    # A stop string that spans the end of token 3 and the start of token 4.
    stop = words[2][1:] + " " + words[3][:2]
    cut = free.text.index(stop)
    for include in (False, True):
        params = SamplingParams(max_new_tokens=10, stop=["zzz", stop],
                                include_stop_str_in_output=include)
        out = engine.generate([prompt], params)[0]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert out.token_ids == free.token_ids[:4]
        assert out.text == free.text[:cut + (len(stop) if include else 0)]
        shown = []
        for delta in engine.stream([prompt], params):
            shown.append(delta.text)
            # Never shows a character that could still be the start of the stop string.
            assert stop not in "".join(shown) or include
        assert "".join(shown) == out.text
    by_id = engine.generate([prompt], SamplingParams(max_new_tokens=10,
                                                      stop_token_ids=[free.token_ids[2]]))[0]
    assert by_id.outputs[0].stop_reason == free.token_ids[2]
    assert engine.stats()["used_blocks"] == 0


def test_min_new_tokens_masks_eos(llama):
    prompt = random_prompts([9], seed=11)[0]
    ref = reference_tokens(llama, [prompt], 8)[0]
    engine = engine_for(llama)
    engine.runner.eos_token_ids = frozenset([ref[0]])     # the first greedy token is EOS
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    assert stopped.token_ids == ref[:1] and stopped.finish_reason == "stop"
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, min_new_tokens=3))[0]
    assert len(out.token_ids) >= 3 and ref[0] not in out.token_ids[:3]
    logits = model_logprobs(llama, prompt)[-1].clone()
    logits[ref[0]] = -float("inf")
    assert out.token_ids[0] == int(logits.argmax())


# -- everything at once under memory pressure ----------------------------------------------------
def test_all_features_under_memory_pressure_same_tokens(llama):
    tok = make_tokenizer()
    prompts = random_prompts([23, 9, 31, 14, 27, 18], seed=12)
    params = [SamplingParams(max_new_tokens=14, temperature=0.8, n=2, seed=3, logprobs=2),
              SamplingParams(max_new_tokens=14, repetition_penalty=1.4, prompt_logprobs=1),
              SamplingParams(max_new_tokens=14, temperature=1.1, top_k=40, top_p=0.9, min_p=0.02,
                             frequency_penalty=0.5, presence_penalty=0.3, seed=4),
              SamplingParams(max_new_tokens=14, logit_bias={17: 3.0}, min_new_tokens=4),
              SamplingParams(max_new_tokens=14, stop=["w1"], temperature=1.0, seed=6),
              SamplingParams(max_new_tokens=14)]

    def run(**cfg):
        engine = engine_for(llama, tok, **cfg)
        outs = engine.generate(prompts, params)
        st = engine.stats()
        assert st["used_blocks"] == 0 and st["failed_steps"] == 0
        engine.check_invariants()
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], \
            [o.outputs[0].logprobs for o in outs], outs[1].prompt_logprobs, st

    calm, calm_lp, calm_pl, _ = run(num_blocks=128)
    for preemption, overlap in (("swap", "off"), ("recompute", "off"), ("swap", "on")):
        got, lp, pl, st = run(block_size=4, num_blocks=20, max_batch_tokens=24, max_num_seqs=6,
                              preemption=preemption, cpu_offload_gib=0.01, overlap=overlap)
        assert got == calm, preemption
        assert st["preemptions"] > 0
        assert (st["swaps_out"] > 0) == (preemption == "swap")
        for a, b in zip(lp, calm_lp):
            assert (a is None) == (b is None)
            if a is not None:
                assert [list(e) for e in a] == [list(e) for e in b]
                assert all(abs(x - y) < TOL for e, f in zip(a, b)
                           for x, y in zip(e.values(), f.values()))
        assert [None if e is None else list(e) for e in pl] == \
            [None if e is None else list(e) for e in calm_pl]


def test_all_greedy_steps_keep_the_greedy_head(llama):
    tok = make_tokenizer()
    prompts = ["w5 w17 w200 w3", "w42 w7"]
    plain = [SamplingParams(max_new_tokens=5, stop=["zz"], stop_token_ids=[1]),
             SamplingParams(max_new_tokens=5, include_stop_str_in_output=True)]
    engine = engine_for(llama, tok, greedy_head=True)
    engine.generate(prompts, plain)
    st = engine.stats()
    assert st["greedy_head_steps"] == st["steps"] > 0       # stop strings change no logits
    for feature in ({"logprobs": 1}, {"repetition_penalty": 1.1}, {"min_new_tokens": 1},
                    {"logit_bias": {3: 0.5}}, {"n": 2}, {"prompt_logprobs": 0}):
        engine = engine_for(llama, tok, greedy_head=True)
        engine.generate(prompts, [plain[0], SamplingParams(max_new_tokens=5, **feature)])
        assert engine.stats()["greedy_head_steps"] == 0, feature


def test_draws_do_not_depend_on_neighbours_or_path(monkeypatch):
    from cb_kernels.engine import sampler

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 300, generator=g) * 2
    mine = [SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01),
            SamplingParams(temperature=1.2, top_p=0.95)]
    others = [SamplingParams(temperature=1.0, top_k=k) for k in (0, 3, 250)]
    u = uniforms(torch.arange(64), torch.full((64,), 7))
    for p in mine:
        alone = [int(sampler.sample_rows(logits[i:i + 1].clone(), [p], u[i:i + 1]))
                 for i in range(64)]
        params = [p if i % 2 == 0 else others[i % 3] for i in range(64)]
        crowd = sampler.sample_rows(logits.clone(), params, u).tolist()
        assert [crowd[i] for i in range(0, 64, 2)] == alone[::2]
        monkeypatch.setattr(sampler, "MAX_CANDIDATES", 0)          # every row over the vocabulary
        assert sampler.sample_rows(logits.clone(), [p] * 64, u).tolist() == alone
        monkeypatch.undo()


def test_unseeded_requests_follow_the_engine_seed(llama):
    prompts = random_prompts([12, 30, 7], seed=13)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def run(seed, **cfg):
        engine = Engine(llama, EngineConfig(attention_backend=ATTN_BACKEND, **cfg), seed=seed)
        return [o.token_ids for o in engine.generate(prompts, params)]

    calm = run(7, block_size=8, num_blocks=64)
    assert run(7, block_size=4, num_blocks=14, max_batch_tokens=16, max_num_seqs=2,
               preemption="recompute") == calm
    assert run(8, block_size=8, num_blocks=64) != calm
