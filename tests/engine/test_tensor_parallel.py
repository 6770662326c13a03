"""Tensor parallelism (engine/distributed.py, runner/tensor_parallel/): 2 CPU ranks over gloo,
started here with torch.multiprocessing (spawn), one torch thread each. One start runs every
token scenario, through EngineConfig(tensor_parallel_size=2) alone or through
Engine(runner=build_runner(...)); its tokens must be those of the same engine at
tensor_parallel_size=1."""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.engine import launcher
from cb_kernels.engine.distributed import TensorParallelError, build_runner
from cb_kernels.runner import tensor_parallel
from helpers import make_model, random_prompts

PREFIX = list(range(1, 40))
GREEDY = SamplingParams(max_new_tokens=8)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=40, seed=7)
# two samples fork from one prompt: copy-on-write block pairs travel with the step
FORKED = SamplingParams(max_new_tokens=5, temperature=0.9, seed=3, n=2, logprobs=2)


def _prompts(seed):
    return random_prompts([5, 17, 3], seed=seed, prefix=PREFIX) + random_prompts([30], seed=seed)


# name -> (model kind, EngineConfig kwargs, prompts, params)
SCENARIOS = {
    "llama_fused": ("llama", {}, _prompts(1), [GREEDY, FORKED, SAMPLED, GREEDY]),
    "llama_transformers_overlap": ("llama", {"pack_weights": False, "overlap": "on"},
                                   _prompts(2), [GREEDY, SAMPLED, GREEDY, GREEDY]),
    "qwen2_transformers": ("qwen2", {"pack_weights": False}, _prompts(3), GREEDY),
    # the 300-token prefill does not fit the header's 1024 inline ints: two broadcasts
    "qwen3_fused": ("qwen3", {}, _prompts(4) + random_prompts([300], seed=8), GREEDY),
    "qwen2_tied_fused": (("qwen2", {"tie_word_embeddings": True}), {}, _prompts(6),
                         [GREEDY, SAMPLED, GREEDY, GREEDY]),
    "llama_pressure": ("llama", {"num_blocks": 12, "block_size": 4, "max_num_seqs": 4},
                       random_prompts([9, 14, 11, 7, 12], seed=5),
                       SamplingParams(max_new_tokens=12)),
}


def _engine(kind, kwargs, size):
    """kind: a helpers.make_model family, or (family, model overrides)."""
    kind, overrides = (kind, {}) if isinstance(kind, str) else kind
    return Engine(make_model(kind, **overrides),
                  EngineConfig(tensor_parallel_size=size, **kwargs))


def _tokens(outputs):
    return [([c.token_ids for c in o.outputs], o.finish_reason,
             None if o.outputs[0].logprobs is None else
             [sorted(d) for d in o.outputs[0].logprobs]) for o in outputs]


def _cancel_run(engine):
    """stream() with the second request cancelled after the first step that yields: request id
    -> (tokens, finish_reason)."""
    prompts = random_prompts([6, 6, 6], seed=9)
    tokens, reasons, cancelled = {}, {}, False
    for out in engine.stream(prompts, SamplingParams(max_new_tokens=10)):
        if engine.rank == 0:
            if not cancelled:
                engine.cancel("req_1")
                cancelled = True
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        else:                       # the other ranks get rank 0's final outputs
            tokens[out.request_id] = list(out.token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason
    return {k: (tokens.get(k, []), reasons[k]) for k in reasons}


def _head_ties(rank):
    """ShardedHead on a 10-row head split 5 | 5: rows 2 (rank 0) and 7 (rank 1) tie for the
    top score of the first input, rows 6 and 8 (both rank 1) for the second's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 8, generator=g) * 0.1
    u, v = torch.zeros(8), torch.zeros(8)
    u[0], v[1] = 1.0, 1.0
    w[2] = w[7] = 10 * u
    w[6] = w[8] = 10 * v
    x = torch.stack([u, v])
    module = torch.nn.Linear(8, 5, bias=False)
    module.weight.data.copy_(w[5 * rank:5 * rank + 5])
    module._cbk_tp = tensor_parallel.TPInfo(rank, 2, None)
    module.cbk_vocab_start = 5 * rank
    head = tensor_parallel.ShardedHead(module, module)
    with torch.no_grad():
        return head.tokens(x).tolist(), torch.equal(head.logits(x), x @ w.T)


def _error(fn):
    """The text of the ValueError fn() raises (None if it raises none)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _runner_api(rank):
    """The runner way in: build_runner on every rank, Engine(runner=) on every rank; rank 0
    generates, rank 1 serves through its runner alone. Then the wrong runners, each refused
    before any collective (the ranks stay in step)."""
    config = EngineConfig(tensor_parallel_size=2)
    model = make_model("llama")
    runner = build_runner(model, config)
    engine = Engine(model, config, runner=runner)
    kind = type(engine.runner).__name__
    outs = engine.generate(_prompts(1), GREEDY) if rank == 0 else runner.serve()
    # the step API: rank 0 steps and releases, the others follow
    if rank == 0:
        for prompt in _prompts(2):
            engine.add_request(prompt, GREEDY)
        stepped = []
        while engine.has_unfinished():
            stepped += engine.step()
        engine.release(stepped)
    else:
        stepped = engine.follow()
    stepped = sorted(stepped, key=lambda o: int(o.request_id.split("_")[1]))
    try:                                 # the other role's call, refused before any collective
        engine.follow() if rank == 0 else engine.release([])
        role_call = None
    except RuntimeError as e:
        role_call = str(e)
    channel = runner.channel
    other = tensor_parallel.StepChannel(1 - rank, 2, channel.group, channel.control,
                                        channel.device, channel.timeout_s)
    wrong = {
        "world": _error(lambda: Engine(model, EngineConfig(tensor_parallel_size=4),
                                       runner=runner)),
        # the role of a rank is fixed by its rank: rank 0 drives, the others follow
        "role": _error(lambda: (tensor_parallel.DriverRunner, tensor_parallel.FollowerRunner)
                       [rank == 0](runner.local, channel)),
        # the other rank's runner (its channel says rank 1 - rank) in this process
        "other_rank": _error(lambda: Engine(model, config, runner=tensor_parallel.make_runner(
            runner.local, other))),
        "not_split": _error(lambda: Engine(make_model("llama"), config, runner=runner)),
    }
    return (_tokens(outs), kind, engine.stats()["local_num_kv_heads"], wrong, _tokens(stepped),
            role_call)


def _scenarios_main(rank, queue):
    try:
        results = {"head": _head_ties(rank)}
        for name, (kind, kwargs, prompts, params) in SCENARIOS.items():
            engine = _engine(kind, kwargs, 2)
            outs = engine.generate(prompts, params)
            s = engine.stats()
            model = engine.runner.local.model         # this rank's TransformersRunner
            embed, head = model.get_input_embeddings(), model.get_output_embeddings()
            results[name] = (_tokens(outs), {k: s[k] for k in (
                "tensor_parallel_size", "local_num_kv_heads", "preemptions", "prefix_hit_blocks",
                "recomputes")}, tuple(engine.runner.k_caches[0].shape),
                engine.runner.local.fused is not None,
                (tuple(embed.weight.shape), tuple(head.weight.shape),
                 embed.weight is head.weight))
        results["runner"] = _runner_api(rank)
        engine = _engine("llama", {}, 2)
        results["cancel"] = _cancel_run(engine)
        if rank == 1:                               # a step of its own is refused, clearly
            engine.add_request([1, 2, 3])
            results["follower"] = [o.error for o in engine.step()]
        try:                                         # 4 ranks wanted, the world has 2
            Engine(make_model("llama", num_key_value_heads=4), EngineConfig(tensor_parallel_size=4))
            results["world"] = None
        except ValueError as e:
            results["world"] = str(e)
        queue.put((rank, results))
    except BaseException as e:                      # noqa: BLE001 (reported to the test)
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise


def _die_main(rank, queue, mode):
    """Rank 1 dies (os._exit) or hangs (sleeps) in its third step; mode "die0": rank 0 dies
    in its third, between broadcasting the step and running it."""
    assert not torch.distributed.is_initialized()     # the Engine makes the group (torchrun)
    engine = _engine("llama", {"tensor_parallel_timeout_s": 5.0}, 2)
    if rank == (0 if mode == "die0" else 1):
        calls = [0]
        runner = engine.runner.local              # what follow() runs
        real = runner.execute

        def execute(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                if mode.startswith("die"):
                    os._exit(3)
                time.sleep(120)
            return real(*args, **kwargs)
        runner.execute = execute
    start = time.perf_counter()
    try:
        engine.generate(random_prompts([5, 9], seed=3), SamplingParams(max_new_tokens=20))
        queue.put((rank, "finished", time.perf_counter() - start))
    except TensorParallelError as e:
        queue.put((rank, str(e), time.perf_counter() - start))


def _torchrun_like(rank, size, port, fn, args):
    """A rank as torchrun starts it: only the environment, no process group (Engine makes it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    fn(rank, *args)


def _launch(fn, args, timeout_s, tp_timeout_s=30.0, wait_s=120.0, need=(0, 1),
            torchrun=False):
    """Start 2 ranks of fn(rank, queue, *args); the results they put, by rank (once the ranks
    in `need` reported, the others get timeout_s to report, then are killed). `torchrun`: the
    ranks get torchrun's environment instead of a process group."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = launcher.free_port()
    procs = [ctx.Process(target=_torchrun_like, args=(rank, 2, port, fn, (queue, *args)))
             if torchrun else
             ctx.Process(target=launcher._rank_main,
                         args=(rank, 2, port, tp_timeout_s, 1, fn, (queue, *args)))
             for rank in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline and not set(need) <= set(results):
            try:
                item = queue.get(timeout=1.0)
            except Exception:                        # noqa: BLE001 (queue.Empty)
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[item[0]] = item[1:]
    finally:
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
    return results


@pytest.fixture(scope="module")
def tp_results():
    results = _launch(_scenarios_main, (), timeout_s=30)
    assert set(results) == {0, 1}, results
    for rank, (r,) in results.items():
        assert isinstance(r, dict), f"rank {rank}: {r}"
    return results[0][0], results[1][0]


@pytest.mark.one_thread
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tokens_equal_tp1(tp_results, name):
    kind, kwargs, prompts, params = SCENARIOS[name]
    ref = _engine(kind, kwargs, 1)
    want = _tokens(ref.generate(prompts, params))
    rank0, rank1 = tp_results
    assert rank0[name][0] == want
    assert rank1[name][0] == want          # every rank's generate returns the outputs
    stats = rank0[name][1]
    # each rank holds half of the 2 KV heads: the pool shape and the stats say 1
    assert stats["tensor_parallel_size"] == 2 and stats["local_num_kv_heads"] == 1
    assert rank0[name][2][2] == 1 and rank1[name][2][2] == 1
    assert ref.runner.k_caches[0].shape[2] == 2
    if name.endswith("fused"):
        assert rank0[name][3] and rank1[name][3]    # the fused forward ran under TP
    # embedding and head: half the vocabulary rows each; a tied pair stays one Parameter
    hidden = ref.runner.model.config.hidden_size
    tied = name == "qwen2_tied_fused"
    assert rank0[name][4] == rank1[name][4] == ((250, hidden), (250, hidden), tied)
    if name == "llama_pressure":
        assert stats["preemptions"] > 0 and stats["recomputes"] > 0
        assert ref.stats()["preemptions"] > 0
    elif name == "llama_fused":
        assert stats["prefix_hit_blocks"] > 0


@pytest.mark.one_thread
def test_cancelled_request(tp_results):
    want = _cancel_run(_engine("llama", {}, 1))
    rank0, rank1 = tp_results
    assert rank0["cancel"] == want
    assert want["req_1"][1] == "cancelled" and want["req_0"][1] == "length"
    assert rank1["cancel"] == want


def test_other_ranks_refuse_steps_of_their_own(tp_results):
    (error,) = tp_results[1]["follower"]
    assert "rank 1 of a tensor-parallel engine runs rank 0's steps" in error


def test_sharded_head_breaks_ties_like_argmax(tp_results):
    for r in tp_results:                        # the lowest index wins, across and within ranks
        assert r["head"] == ([2, 6], True)


@pytest.mark.one_thread
def test_runner_api_equals_tp1(tp_results):
    """Engine(model, config, runner=build_runner(model, config)) on every rank: rank 0 drives,
    rank 1's runner serves its steps; the tokens of one process."""
    want = _tokens(_engine("llama", {}, 1).generate(_prompts(1), GREEDY))
    rank0, rank1 = (r["runner"] for r in tp_results)
    assert rank0[:3] == (want, "DriverRunner", 1)
    assert rank1[:3] == (want, "FollowerRunner", 1)
    # add_request/step on rank 0, then release(outputs): rank 1's follow() returns them
    want = _tokens(_engine("llama", {}, 1).generate(_prompts(2), GREEDY))
    assert rank0[4] == rank1[4] == want
    assert rank0[5] == ("serve() runs on the ranks other than 0; rank 0 drives (its engine "
                        "steps, then release() ends the session)")
    assert rank1[5] == ("release() ends rank 0's session; rank 1 follows it (serve() returns "
                        "when rank 0 releases)")


def test_wrong_runner_refused(tp_results):
    for rank, r in enumerate(tp_results):
        wrong = r["runner"][3]
        assert wrong["world"] == (f"EngineConfig(tensor_parallel_size=4), but the runner is rank "
                                  f"{rank} of 2: pass every rank the config its runner was built "
                                  "with")
        want = "DriverRunner" if rank == 0 else "FollowerRunner"
        built = "FollowerRunner" if rank == 0 else "DriverRunner"
        assert wrong["role"] == (f"a {built} on rank {rank} of 2: rank 0 drives (DriverRunner), "
                                 f"the others follow (FollowerRunner); this rank needs a {want} "
                                 "(make_runner picks it)")
        assert wrong["other_rank"] == (
            f"the runner is rank {1 - rank} of 2 ({built}), but this process is rank {rank} of "
            "2: build each rank's runner on that rank (build_runner(model, config))")
        assert wrong["not_split"] == (
            f"the model is not split, but the runner is rank {rank} of 2: pass the model the "
            "runner was built from (build_runner(model, config) splits it)")


def test_world_size_refused(tp_results):
    for r in tp_results:
        assert r["world"] is not None
        assert "tensor_parallel_size=4" in r["world"] and "world has 2 processes" in r["world"]


@pytest.mark.parametrize("overrides,size,message", [
    ({"num_key_value_heads": 1}, 2,
     r"tensor_parallel_size=2 does not divide num_key_value_heads=1"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48}, 4,
     r"tensor_parallel_size=4 does not divide num_key_value_heads=2"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48}, 2,
     r"does not divide num_key_value_heads=3"),
    ({"intermediate_size": 129}, 2, r"does not divide intermediate_size=129"),
    ({"vocab_size": 501}, 2, r"does not divide vocab_size \(LM head rows\)=501"),
])
def test_sizes_that_do_not_split_are_refused(overrides, size, message):
    model = make_model("llama", **overrides)
    with pytest.raises(ValueError, match=message):
        Engine(model, EngineConfig(tensor_parallel_size=size))
    assert tensor_parallel.info_of(model) is None          # nothing split


def test_no_process_group_refused(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"no torch.distributed process group.*torchrun "
                                           r"--nproc-per-node 2.*--tensor-parallel-size 2"):
        Engine(make_model("llama"), EngineConfig(tensor_parallel_size=2))


def test_config_checks():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s must be > 0"):
        EngineConfig(tensor_parallel_timeout_s=0)
    e = Engine(make_model("llama"))
    assert e.stats()["tensor_parallel_size"] == 1 and e.stats()["local_num_kv_heads"] == 2


@pytest.mark.parametrize("mode", ["die", "hang", "die0"])
def test_lost_rank_ends_the_run(mode):
    """A rank that dies (or hangs) mid-run: the live rank raises TensorParallelError, within
    the timeout (5 s here), instead of waiting forever. The ranks start as under torchrun (the
    Engine makes the process group from the environment)."""
    live = 1 if mode == "die0" else 0
    results = _launch(_die_main, (mode,), timeout_s=1, need=(live,), torchrun=True)
    assert live in results, results
    message, seconds = results[live]
    assert "lost step with the other ranks" in message and f"rank {live} of 2" in message
    assert "5 s tensor_parallel_timeout_s" in message
    assert seconds < 15
    if mode.startswith("die"):
        assert 1 - live not in results


def test_cli_generate_starts_the_ranks(tiny_checkpoint, tmp_path):
    """`cb-kernels generate --tensor-parallel-size 2` outside torchrun spawns the 2 ranks itself;
    rank 0 writes the same results as one process does."""
    import json

    from cb_kernels import cli

    prompts = random_prompts([4, 19, 9], seed=11)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": [t % 300 for t in p]})
                           + "\n" for i, p in enumerate(prompts)))
    results = {}
    for size in (1, 2):
        dst = tmp_path / f"out{size}.jsonl"
        assert cli.main(["generate", "--model", str(tiny_checkpoint), "--input", str(src),
                         "--output", str(dst), "--max-new-tokens", "6", "--ignore-eos",
                         "--device", "cpu", "--dtype", "float32", "--num-blocks", "32",
                         "--tensor-parallel-size", str(size)]) == 0
        results[size] = [(r["id"], r["token_ids"], r["finish_reason"])
                         for r in map(json.loads, dst.read_text().splitlines())]
    assert sorted(results[2]) == sorted(results[1]) and len(results[1]) == 3
    # a model that does not split: every rank refuses it, the command says why in one line
    from transformers import LlamaConfig, LlamaForCausalLM

    one_kv = tmp_path / "one_kv"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(one_kv)
    with pytest.raises(SystemExit, match=r"--tensor-parallel-size 2: rank \d failed: ValueError: "
                                         r"tensor_parallel_size=2 does not divide "
                                         r"num_key_value_heads=1"):
        cli.main(["generate", "--model", str(one_kv), "--input", str(src),
                  "--output", str(tmp_path / "out_bad.jsonl"), "--device", "cpu",
                  "--dtype", "float32", "--tensor-parallel-size", "2"])


def _nccl_main(rank, queue):
    torch.cuda.set_device(rank)
    model = make_model("llama").to(f"cuda:{rank}")
    engine = Engine(model, EngineConfig(tensor_parallel_size=2))
    outs = engine.generate(_prompts(1), GREEDY)
    queue.put((rank, (_tokens(outs), engine.stats()["local_num_kv_heads"])))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL tensor parallelism needs 2 GPUs (NCCL refuses two ranks on one)")
def test_nccl_two_gpus_equal_tp1():
    results = _launch(_nccl_main, (), timeout_s=30)
    want = _tokens(Engine(make_model("llama").cuda()).generate(_prompts(1), GREEDY))
    assert results[0][0] == (want, 1) and results[1][0] == (want, 1)


def test_swap_and_runner_refused():
    from cb_kernels.runner import TransformersRunner

    model = make_model("llama")
    for kwargs in ({"preemption": "swap"}, {"cpu_offload_gib": 1.0}):
        with pytest.raises(ValueError, match="tensor_parallel_size=2 preempts by recompute only"):
            Engine(model, EngineConfig(tensor_parallel_size=2, **kwargs))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs a tensor-parallel "
                                         r"runner, got a TransformersRunner: .*build_runner"):
        Engine(model, EngineConfig(tensor_parallel_size=2), runner=TransformersRunner(model))
    with pytest.raises(ValueError, match=r"needs EngineConfig\(tensor_parallel_size=N\) with "
                                         r"N > 1 .* got 1"):
        build_runner(model, EngineConfig())
    assert tensor_parallel.info_of(model) is None


def test_model_split_by_transformers_refused():
    model = make_model("llama")
    model._tp_size = 2                   # what from_pretrained(tp_plan=...) leaves on a model
    with pytest.raises(ValueError, match=r"loaded already split by transformers \(tp_plan"):
        Engine(model, EngineConfig(tensor_parallel_size=2))


class _Stop(Exception):
    pass


def _fake_cuda(monkeypatch, calls, local_rank=1):
    """A stand-in GPU host on the CPU: torch.cuda says yes, set_device records its index."""
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))


def test_engine_setup_selects_the_local_rank_gpu_before_the_process_group(monkeypatch):
    """Each rank takes cuda:LOCAL_RANK (torch.cuda.set_device) before NCCL starts (issue #31):
    else every rank of a host would sit on GPU 0."""
    import types

    from cb_kernels.engine import distributed

    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(tensor_parallel, "check_shardable", lambda model, n: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)

    def init(backend, **kwargs):
        calls.append(("init_process_group", backend))
        raise _Stop
    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    param = types.SimpleNamespace(device=torch.device("cuda", 1))
    model = types.SimpleNamespace(config=None, get_output_embeddings=lambda: None,
                                  parameters=lambda: iter([param]))
    with pytest.raises(_Stop):
        distributed.setup(model, EngineConfig(tensor_parallel_size=2))
    assert calls == [("set_device", 1), ("init_process_group", "nccl")]

    calls.clear()                   # a model left on another GPU than the rank's is refused
    param.device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1.*on cuda:0; move it to cuda:1"):
        distributed.setup(model, EngineConfig(tensor_parallel_size=2))
    assert calls == [("set_device", 1)]
    assert distributed.select_device(torch.device("cpu")) == torch.device("cpu")


def test_cli_selects_the_local_rank_gpu_before_the_model_moves(monkeypatch, tmp_path):
    """`cb-kernels generate --tensor-parallel-size 2 --device cuda` under torchrun: set_device
    (LOCAL_RANK) comes first, then the model moves to that GPU."""
    import cb_kernels.models
    from cb_kernels import cli, generate_cli

    calls = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setattr(generate_cli, "_in_process_group", lambda: True)

    class Model:
        def to(self, device):
            calls.append(("to", str(device)))
            raise _Stop
    monkeypatch.setattr(cb_kernels.models, "load", lambda *a, **k: (Model(), None))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    with pytest.raises(_Stop):
        cli.main(["generate", "--model", "m", "--input", str(src), "--output",
                  str(tmp_path / "out.jsonl"), "--device", "cuda", "--dtype", "float32",
                  "--tensor-parallel-size", "2"])
    assert calls == [("set_device", 1), ("to", "cuda:1")]
