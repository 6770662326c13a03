"""Overlapped steps (engine/step_loop.py) on CPU, where overlap="on" runs the same loop with a
synchronous device: step N+1 is scheduled and launched before step N's tokens are read, its
placeholder inputs filled from step N's token tensor. Every test compares the tokens with an
oracle (transformers' greedy generate, cut at stop tokens and cancellations) or with overlap off,
and checks the invariants after every step; the counters prove the pipeline really ran."""
import itertools

import pytest
import torch

from cb_kernels.engine import Engine, EngineConfig, SamplingParams
from cb_kernels.engine import placeholders
from cb_kernels.runner.cuda_graphs import decode_graph_runner
from cb_kernels.engine.swapper import OffloadError
from tests.helpers import ATTN_BACKEND, fail_nth_model_run, make_model, random_prompts, reference_tokens

pytestmark = pytest.mark.one_thread
BLOCK_SIZE = 4
LENGTHS = [5, 37, 12, 30, 1, 23, 18, 9, 14, 3]
NEW = [30, 25, 16, 20, 36, 12, 28, 33, 7, 22]


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def workload(llama):
    system = random_prompts([9], seed=21)[0]      # shared prefix: prefix-cache hits
    prompts = random_prompts(LENGTHS[:5], seed=22) + random_prompts(LENGTHS[5:], seed=23,
                                                                      prefix=system)
    return prompts, reference_tokens(llama, prompts, NEW)


def make_engine(model, overlap, num_blocks=200, host_blocks=0, **kw):
    c = model.config
    block_bytes = c.num_hidden_layers * 2 * BLOCK_SIZE * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads) * 4
    cfg = dict(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=32, max_num_seqs=8,
               cpu_offload_gib=host_blocks * block_bytes / (1 << 30), overlap=overlap,
               attention_backend=ATTN_BACKEND)
    return Engine(model, EngineConfig(**{**cfg, **kw}))


def run(engine, prompts, params, cancel_at=None):
    """Step until idle, check_invariants() after every step; request k is cancelled as soon as
    it shows cancel_at[k] tokens. Returns the outputs in prompt order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {}
    for _ in range(5000):
        for out in engine.step():
            assert not out.token_ids or min(out.token_ids) >= 0, out
            outs[out.request_id] = out
        engine.check_invariants()
        for k, count in (cancel_at or {}).items():
            seq = engine.sequence(ids[k])
            if seq is not None and len(seq.output_token_ids) >= count:
                assert len(seq.output_token_ids) == count, "more than one token per step"
                engine.cancel(ids[k])
        if not engine.has_unfinished():
            break
    for out in engine.step():          # the cancellations of the last step
        outs[out.request_id] = out
    engine.check_invariants()
    st = engine.stats()
    assert st["used_blocks"] == 0 and st["host_used_blocks"] == 0, st
    return [outs[i] for i in ids]


def expected(ref, stops, cancel_at):
    """(tokens, finish_reason) per request: the greedy tokens cut after the first stop token,
    then at the cancellation point."""
    out = []
    for k, tokens in enumerate(ref):
        cut = [i for i, t in enumerate(tokens) if t in stops.get(k, ())]
        reason = "length"
        if cut:
            tokens, reason = tokens[:cut[0] + 1], "stop"
        if k in cancel_at and cancel_at[k] < len(tokens):
            tokens, reason = tokens[:cancel_at[k]], "cancelled"
        out.append((tokens, reason))
    return out


def scenario(ref):
    """Stop tokens met mid-output for some requests, cancellations for others."""
    stops = {1: (ref[1][6],), 3: (ref[3][0],), 6: (ref[6][15],), 8: (ref[8][2], ref[8][5])}
    cancel_at = {2: 4, 5: 9, 7: 1, 9: 13}
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=stops.get(k, ()))
              for k, n in enumerate(NEW)]
    return params, stops, cancel_at


@pytest.mark.parametrize("preemption, num_blocks, host_blocks", [
    ("recompute", 200, 0),       # no pressure
    ("recompute", 20, 0),        # the longest request (37 + 25 tokens) needs 16 blocks of 4
    ("swap", 20, 200),
])
def test_overlap_matches_sync_and_generate(llama, workload, preemption, num_blocks, host_blocks):
    prompts, ref = workload
    params, stops, cancel_at = scenario(ref)
    want = expected(ref, stops, cancel_at)
    stats = {}
    for overlap in ("off", "on"):
        engine = make_engine(llama, overlap, num_blocks, host_blocks, preemption=preemption)
        outs = run(engine, prompts, params, cancel_at)
        assert [(o.token_ids, o.finish_reason) for o in outs] == want, overlap
        stats[overlap] = engine.stats()
    on, off = stats["on"], stats["off"]
    assert off["overlapped_steps"] == 0 and off["placeholder_fills"] == 0
    assert on["overlapped_steps"] > 0.8 * on["steps"], on
    assert on["placeholder_fills"] > 100 and on["discarded_tokens"] > 0, on
    assert on["generated_tokens"] == off["generated_tokens"] == sum(len(t) for t, _ in want)
    if num_blocks < 100:
        key = "swaps_out" if preemption == "swap" else "recomputes"
        assert on[key] > 0 and off[key] > 0, (on, off)
    if preemption == "swap":
        assert 0 < on["swaps_in"] <= on["swaps_out"]    # a swapped request may end swapped


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_while_its_token_is_unknown(llama, workload, monkeypatch, preemption):
    """Every other schedule first preempts the newest request whose last token is still a
    placeholder; with room in the pool the same schedule takes it back (re-admitted with its
    prefix-cache hits, or swapped in), so the placeholder is fed by a prefill row or by a swapped-in
    decode row, and the tokens must not change."""
    prompts, ref = workload
    engine = make_engine(llama, "on", host_blocks=200, preemption=preemption)
    sched, real_schedule, calls = engine.scheduler, engine.scheduler.schedule, [0]

    def schedule():
        calls[0] += 1
        pending = [s for s in sched.running if s.has_placeholder]
        if pending and calls[0] % 2:
            sched._preempt(pending[-1])
        return real_schedule()

    rows = {"prefill": 0, "decode": 0}
    real_rows = placeholders.placeholder_rows

    def counted_rows(batch, prev, block_size):
        dst, src, late = real_rows(batch, prev, block_size)
        ends = dict(zip(itertools.accumulate(batch.num_new_tokens), batch.num_new_tokens))
        for d in dst:
            rows["prefill" if ends[d + 1] > 1 else "decode"] += 1
        return dst, src, late

    monkeypatch.setattr(sched, "schedule", schedule)
    monkeypatch.setattr(placeholders, "placeholder_rows", counted_rows)
    outs = run(engine, prompts, [SamplingParams(max_new_tokens=n) for n in NEW])
    assert [o.token_ids for o in outs] == ref
    st = engine.stats()
    if preemption == "recompute":
        assert st["recomputes"] > 10 and rows["prefill"] > 5, (st, rows)
    else:
        assert st["swaps_in"] > 10 and rows["decode"] > 100, (st, rows)


def test_seeded_sampling_and_greedy_mix_match(llama, workload):
    prompts, _ = workload
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_k=40, top_p=0.9, seed=k)
              if k % 3 == 0 else SamplingParams(max_new_tokens=n) for k, n in enumerate(NEW)]
    got = {}
    for overlap in ("off", "on"):
        engine = make_engine(llama, overlap, num_blocks=24, preemption="recompute")
        got[overlap] = [o.token_ids for o in run(engine, prompts, params)]
        if overlap == "on":
            # Steps with sampled rows resolve at once; pure greedy steps still overlap.
            assert engine.stats()["overlapped_steps"] > 0
    assert got["on"] == got["off"]
    assert sum(map(len, got["on"])) == sum(NEW)


def test_failed_step_in_flight_fails_only_its_requests(llama, workload, monkeypatch):
    prompts, ref = workload
    engine = make_engine(llama, "on", num_blocks=60)
    fail_nth_model_run(monkeypatch, engine.runner, 6)
    outs = run(engine, prompts, [SamplingParams(max_new_tokens=n) for n in NEW])
    failed = [k for k, o in enumerate(outs) if o.finish_reason == "error"]
    assert failed and engine.stats()["failed_steps"] == 1
    for k, o in enumerate(outs):
        if k in failed:
            assert "injected kernel failure" in o.error
            assert o.token_ids == ref[k][:len(o.token_ids)]
        else:
            assert o.token_ids == ref[k] and o.finish_reason == "length"
    later = run(engine, prompts[:2], [SamplingParams(max_new_tokens=n) for n in NEW[:2]])
    assert [o.token_ids for o in later] == ref[:2]


def test_requests_ending_by_length_cost_no_extra_rows(llama, workload):
    """A request whose in-flight step gives its last token (max_new_tokens) is retired before
    the next schedule: no discarded rows and as many steps and tokens as without overlap."""
    prompts, ref = workload
    params = [SamplingParams(max_new_tokens=n) for n in NEW]
    stats = {}
    for overlap in ("off", "on"):
        engine = make_engine(llama, overlap)
        assert [o.token_ids for o in run(engine, prompts, params)] == ref
        stats[overlap] = engine.stats()
    assert stats["on"]["discarded_tokens"] == 0 and stats["on"]["overlapped_steps"] > 0
    assert stats["on"]["steps"] == stats["off"]["steps"]


def test_stream_deltas_with_overlap(llama, workload):
    """stream() reads the tokens between steps: never a placeholder, each token once."""
    prompts, ref = workload
    params, stops, _ = scenario(ref)
    want = expected(ref, stops, {})
    engine = make_engine(llama, "on", num_blocks=20, preemption="recompute")
    got, reasons = {}, {}
    for delta in engine.stream(prompts, params):
        assert delta.request_id not in reasons and min(delta.token_ids, default=0) >= 0
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.finished:
            reasons[delta.request_id] = delta.finish_reason
    order = sorted(got, key=lambda rid: int(rid.rsplit("_", 1)[1]))     # req_0, req_1, ...
    assert [(got[r], reasons[r]) for r in order] == want
    assert engine.stats()["overlapped_steps"] > 0


def test_cancel_while_in_flight_keeps_the_shown_tokens(llama, workload):
    prompts, ref = workload
    engine = make_engine(llama, "on")
    short = [prompts[0], prompts[2], prompts[4]]          # one prefill step for all three
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in short]
    engine.step()
    engine.step()
    assert engine.loop.in_flight is not None and engine.stats()["overlapped_steps"] == 1
    shown = list(engine.sequence(ids[1]).output_token_ids)
    assert len(shown) == 1
    engine.cancel(ids[1])
    engine.check_invariants()
    ended = engine.step()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in ended] == \
        [(ids[1], shown, "cancelled")]
    engine.check_invariants()
    assert engine.stats()["discarded_tokens"] == 1


def test_block_filled_by_a_placeholder_is_hashed_once_known(llama):
    """Prompt 13 tokens, block 4: each decode that fills a block (positions 15, 19, 23) has a
    placeholder as its input token, so that block's hash waits for the token. A second request
    whose prompt is all 25 tokens of the first hits 6 blocks; the 6th (positions 20..23, filled
    by the last decode) is registered only by the commit after the token arrived."""
    prompt = random_prompts([13], seed=31)[0]
    out = reference_tokens(llama, [prompt], [12])[0]
    follow = prompt + out
    want = reference_tokens(llama, [follow], [6])[0]
    for overlap in ("off", "on"):
        engine = make_engine(llama, overlap)
        first = run(engine, [prompt], [SamplingParams(max_new_tokens=12)])[0]
        assert first.token_ids == out
        hits = engine.stats()["prefix_hit_blocks"]
        second = run(engine, [follow], [SamplingParams(max_new_tokens=6)])[0]
        assert second.token_ids == want
        assert engine.stats()["prefix_hit_blocks"] - hits == 6, overlap


def test_graph_runner_static_inputs_get_the_filled_tokens(llama, workload):
    """The decode-graph path (eager here: capture=False on CPU) copies the step's input_ids into
    its static buffer after the placeholders were filled on the device."""
    prompts, ref = workload
    engine = make_engine(llama, "on")
    engine.runner.graphs = graphs = decode_graph_runner(engine.runner, 8, 64)
    graphs.capture = False
    outs = run(engine, prompts[:6], [SamplingParams(max_new_tokens=n) for n in NEW[:6]])
    assert [o.token_ids for o in outs] == ref[:6]
    assert graphs.eager_runs > 10 and engine.stats()["placeholder_fills"] > 50


def test_fill_placeholders_ranges_and_scattered_rows():
    prev = torch.tensor([70, 71, 72, 73, 74])
    ids = torch.full((8,), -1, dtype=torch.int64)
    moved = []
    placeholders.fill_placeholders(ids, [2, 3, 4], [1, 2, 3], prev, lambda t: moved.append(t) or t)
    assert ids.tolist() == [-1, -1, 71, 72, 73, -1, -1, -1] and moved == []
    placeholders.fill_placeholders(ids, [0, 7, 5], [4, 0, 2], prev, lambda t: moved.append(t) or t)
    assert ids.tolist() == [74, -1, 71, 72, 73, 72, -1, 70] and len(moved) == 1
    placeholders.fill_placeholders(ids, [], [], prev, None)


def test_overlap_modes_resolve(llama):
    assert make_engine(llama, "on").loop.overlap and not make_engine(llama, "off").loop.overlap
    assert not make_engine(llama, "auto").loop.overlap        # auto: on for CUDA only
    assert make_engine(llama, "on").loop.clock.stats()["timed_steps"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_overlap_on_gpu_matches_and_is_timed(graphs):
    model = make_model("llama", hidden_size=128, intermediate_size=256, head_dim=32).cuda()
    prompts = random_prompts(LENGTHS, seed=24)
    params = [SamplingParams(max_new_tokens=n) for n in NEW]
    got = {}
    for overlap in ("off", "on"):
        engine = make_engine(model, overlap, num_blocks=20, host_blocks=200,
                             preemption="swap", cuda_graphs=graphs)
        engine.loop.clock.device_events = True
        got[overlap] = [o.token_ids for o in run(engine, prompts, params)]
        torch.cuda.synchronize()
        st = engine.stats()
        assert st["timed_steps"] == st["steps"] and st["device_busy_s"] > 0, st
        assert (st["overlapped_steps"] > 0) == (overlap == "on")
    assert got["on"] == got["off"]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_failed_swap_of_a_request_whose_token_in_flight_stops_it(llama, workload, monkeypatch,
                                                                   overlap):
    """With overlap on, a request is scheduled again before its stop token is read; a failed
    swap-out of it in that schedule must not turn its "stop" into an "error" (without overlap
    it had ended before that schedule)."""
    prompts, ref = workload
    k, at = 3, 4                                        # request 3 stops at its 5th token
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=(ref[k][at],) if i == k else ())
              for i, n in enumerate(NEW)]
    engine = make_engine(llama, overlap, host_blocks=200, preemption="swap")
    sched, real_schedule, victims = engine.scheduler, engine.scheduler.schedule, []

    def schedule():
        seq = engine.sequence(f"req_{k}")
        if seq is not None and seq in sched.running and len(seq.output_token_ids) == at + 1:
            victims.append(seq)          # its stop token is in flight (overlap) or known (off)
            sched._preempt(seq)
        return real_schedule()

    def failing_swap_out(seq):
        raise OffloadError("injected swap-out failure")

    monkeypatch.setattr(sched, "schedule", schedule)
    monkeypatch.setattr(engine.swapper, "swap_out", failing_swap_out)
    monkeypatch.setattr(engine.swapper, "choose", lambda seq: "swap")
    outs = run(engine, prompts, params)
    assert (outs[k].token_ids, outs[k].finish_reason, outs[k].error) == \
        (ref[k][:at + 1], "stop", None)
    assert [o.token_ids for i, o in enumerate(outs) if i != k] == \
        [t for i, t in enumerate(ref) if i != k]
    assert len(victims) == (1 if overlap == "on" else 0)
