"""`cb-kernels demo` end to end (shortened) and `cb-kernels generate` round-tripping a jsonl file."""
import json

import pytest
import torch

from cb_kernels import cli
from cb_kernels.generate_cli import read_records


def test_demo_runs_end_to_end(smollm2, capsys):
    assert cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
                     "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "[1] What is the capital of France?" in out
    assert "cb_kernels Engine:" in out and "transformers generate_batch:" in out and "speedup:" in out
    assert "identical answers: 2/2\n" in out


def test_demo_no_compare_and_bad_flags(smollm2, capsys):
    assert cli.main(["demo", "--num-prompts", "1", "--max-new-tokens", "2", "--no-compare", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cb_kernels Engine:" in out and "generate_batch:" not in out
    from cb_kernels.models import fast_dtype
    dtype, why = fast_dtype(torch.bfloat16)         # the bundled checkpoint is bf16
    assert f"dtype: {str(dtype).replace('torch.', '')} ({why})" in out
    with pytest.raises(SystemExit, match="--num-prompts must be >= 1"):
        cli.main(["demo", "--num-prompts", "0"])


@pytest.mark.parametrize("avx512_bf16, amx, checkpoint, device, want", [
    (True, False, torch.bfloat16, "cpu", torch.bfloat16),
    (False, True, torch.bfloat16, "cpu", torch.bfloat16),
    (False, False, torch.bfloat16, "cpu", torch.float32),
    (True, False, torch.float16, "cpu", torch.bfloat16),
    (False, False, torch.float16, "cpu", torch.float32),
    (True, True, torch.float32, "cpu", torch.float32),
    (False, False, torch.float32, "cuda", torch.bfloat16),
    (False, False, torch.float16, "cuda", torch.float16),
])
def test_fast_dtype_follows_the_cpu_features(monkeypatch, avx512_bf16, amx, checkpoint, device, want):
    from cb_kernels.models import fast_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    dtype, why = fast_dtype(checkpoint, device)
    assert dtype == want and why


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.one_thread
def test_generate_round_trips_jsonl(tiny_checkpoint, tmp_path):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (3, 20, 7, 33)]
    records = [{"id": f"p{i}", "prompt_token_ids": p} for i, p in enumerate(prompts)]
    records.append({"id": "too-long", "prompt_token_ids": [5] * 400})   # past max_position_embeddings
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, records)
    argv = ["generate", "--model", str(tiny_checkpoint), "--input", str(src), "--output", str(dst),
            "--max-new-tokens", "6", "--ignore-eos", "--block-size", "16", "--num-blocks", "32",
            "--max-batch-tokens", "64"]
    assert cli.main(argv) == 0
    results = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(results) == {r["id"] for r in records}
    assert results["too-long"]["finish_reason"] == "error" and "400" in results["too-long"]["error"]

    from cb_kernels.models import load
    model, _ = load(tiny_checkpoint, dtype="float32")
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
            r = results[f"p{i}"]
            assert r["token_ids"] == ref[0, len(p):].tolist() and r["index"] == i
            assert r["finish_reason"] == "length" and r["num_prompt_tokens"] == len(p)

    # --resume keeps finished results and runs only what is missing (here: a cut last line).
    lines = dst.read_text().splitlines()
    kept = [json.loads(x)["id"] for x in lines[:-1]]
    dst.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    assert cli.main(argv + ["--resume"]) == 0
    again = [json.loads(x)["id"] for x in dst.read_text().splitlines()]
    assert again[:len(kept)] == kept and sorted(again) == sorted(results)


@pytest.mark.parametrize("content, match", [
    ("{not json}\n", "line 1: not JSON"),
    ('{"text": "x"}\n', "line 1: expected a string or an object"),
    ('"a"\n{"id": "0", "prompt": "b"}\n', "ids must be unique; id '0' is on lines 1 and 2"),
    ('"a"\n"\xff b"\n', "line 2: not UTF-8"),
], ids=["not-json", "no-prompt-key", "duplicate-id", "not-utf8"])
def test_generate_rejects_bad_input(tmp_path, content, match):
    path = tmp_path / "in.jsonl"
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(SystemExit, match=match):
        read_records(path)


def test_generate_bad_option(tiny_checkpoint, tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt_token_ids": [1, 2]}])
    with pytest.raises(SystemExit, match="bad option: .*top_p"):
        cli.main(["generate", "--model", str(tiny_checkpoint), "--input", str(src),
                  "--output", str(tmp_path / "o.jsonl"), "--top-p", "0"])


@pytest.mark.one_thread
def test_generate_text_and_chat_records(smollm2, tmp_path):
    model, tokenizer = smollm2
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    question = "What is the capital of France?"
    _write_jsonl(src, [question, {"id": "chat", "messages": [{"role": "user", "content": question}]}])
    assert cli.main(["generate", "--model", "smollm2-135m", "--input", str(src), "--output", str(dst),
                     "--chat", "--max-new-tokens", "8", "--num-blocks", "16", "--block-size", "16"]) == 0
    results = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(results) == {"0", "chat"}
    # --chat wraps a text prompt in the same template a "messages" record gets
    assert results["0"]["token_ids"] == results["chat"]["token_ids"]
    assert "Paris" in results["chat"]["text"]


def test_generate_interrupted_keeps_results(tiny_checkpoint, tmp_path, monkeypatch):
    from cb_kernels import Engine

    records = [{"id": f"p{i}", "prompt_token_ids": [i + 1] * (3 + i)} for i in range(5)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, records)
    argv = ["generate", "--model", str(tiny_checkpoint), "--input", str(src), "--output", str(dst),
            "--max-new-tokens", "3", "--ignore-eos", "--max-num-seqs", "1", "--num-blocks", "8"]
    step = Engine.step
    finished = []

    def step_then_interrupt(self):
        if len(finished) >= 2:
            raise KeyboardInterrupt
        out = step(self)
        finished.extend(out)
        return out

    monkeypatch.setattr(Engine, "step", step_then_interrupt)
    assert cli.main(argv) == 130
    kept = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in kept] == ["p0", "p1"] and all(len(r["token_ids"]) == 3 for r in kept)

    monkeypatch.setattr(Engine, "step", step)
    assert cli.main(argv + ["--resume"]) == 0
    ids = [json.loads(line)["id"] for line in dst.read_text().splitlines()]
    assert ids == ["p0", "p1", "p2", "p3", "p4"]


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a word tokenizer (w1..w299 are in its vocabulary) whose chat
    template calls a method on each message's content, as real templates do."""
    import shutil

    from tests.helpers import make_tokenizer

    path = tmp_path_factory.mktemp("tiny_chat")
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, path)
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}w1 {{ m['content'].strip() }} {% endfor %}"
                         "{% if add_generation_prompt %}w2{% endif %}")
    tok.save_pretrained(path)
    return path


def _generate(checkpoint, src, dst, *extra):
    return cli.main(["generate", "--model", str(checkpoint), "--input", str(src), "--output",
                     str(dst), "--max-new-tokens", "3", "--ignore-eos", "--num-blocks", "16",
                     "--block-size", "16", *extra])


def _results(dst):
    return {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}


@pytest.mark.one_thread
def test_generate_bad_lines_become_error_records(chat_checkpoint, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [
        {"id": "ids", "prompt_token_ids": [5, 6, 7]},
        {"id": "no-content", "messages": [{"role": "user"}]},
        {"id": "null", "messages": None},
        {"id": "str-ids", "prompt_token_ids": "hello"},
        {"id": "int-prompt", "prompt": 5},
        {"id": "chat", "messages": [{"role": "user", "content": "w7 w8"}]},
    ])
    assert _generate(chat_checkpoint, src, dst) == 0
    res = _results(dst)
    assert len(res) == 6 and dst.read_text().count("\n") == 6
    assert res["ids"]["finish_reason"] == res["chat"]["finish_reason"] == "length"
    errors = {
        "no-content": "line 2: the chat template cannot render 'messages' (UndefinedError",
        "null": "line 3: 'messages' must be a non-empty list of objects",
        "str-ids": "line 4: 'prompt_token_ids' must be a list of ints, got \"hello\"",
        "int-prompt": "line 5: 'prompt' must be a string, got 5"}
    for rid, message in errors.items():
        assert res[rid]["finish_reason"] == "error" and res[rid]["token_ids"] == []
        assert res[rid]["error"].startswith(message), res[rid]["error"]
    assert _generate(chat_checkpoint, src, dst, "--resume") == 0      # nothing left to run
    assert _results(dst) == res and dst.read_text().count("\n") == 6


def test_generate_resume_refuses_another_input_or_settings(tiny_checkpoint, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    records = [{"prompt_token_ids": [i + 1] * (2 + i)} for i in range(3)]
    _write_jsonl(src, records)
    assert _generate(tiny_checkpoint, src, dst) == 0
    first = dst.read_text()
    assert all(len(r["input_fingerprint"]) == len(r["settings_fingerprint"]) == 16
               for r in _results(dst).values())
    assert _generate(tiny_checkpoint, src, dst, "--resume") == 0 and dst.read_text() == first
    _write_jsonl(src, [{"prompt_token_ids": [9, 9]}] + records)       # a line prepended
    with pytest.raises(SystemExit, match=r"id '0' \(--input line 1\) is not the prompt"):
        _generate(tiny_checkpoint, src, dst, "--resume")
    _write_jsonl(src, records)
    with pytest.raises(SystemExit, match="made with other settings"):
        _generate(tiny_checkpoint, src, dst, "--resume", "--temperature", "0.5")
    _write_jsonl(src, records[:2])
    with pytest.raises(SystemExit, match="holds id '2', which --input does not have"):
        _generate(tiny_checkpoint, src, dst, "--resume")
    old = [{k: v for k, v in r.items() if not k.endswith("_fingerprint")}
           for r in map(json.loads, first.splitlines())]
    _write_jsonl(dst, old)
    with pytest.raises(SystemExit, match="without fingerprints"):
        _generate(tiny_checkpoint, src, dst, "--resume")
    assert dst.read_text().count("\n") == 3                          # nothing was appended


def test_generate_checks_input_and_output_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    import cb_kernels.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the files were checked")

    monkeypatch.setattr(cb_kernels.models, "load", no_load)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt_token_ids": [1]}\n"caf\xe9"\n')
    with pytest.raises(SystemExit, match="line 2: not UTF-8"):
        _generate(tiny_checkpoint, src, tmp_path / "out.jsonl")
    _write_jsonl(src, [{"prompt_token_ids": [1]}])
    with pytest.raises(SystemExit, match="is a directory"):
        _generate(tiny_checkpoint, src, tmp_path)
    with pytest.raises(SystemExit, match=r"under .*in\.jsonl, which is a file"):
        _generate(tiny_checkpoint, src, src / "sub" / "out.jsonl")


@pytest.mark.one_thread
def test_generate_sampling_fields_per_line(tiny_checkpoint, tmp_path):
    records = [{"id": "n", "prompt_token_ids": [5, 6, 7], "n": 2, "temperature": 1.0, "seed": 3,
                "logprobs": 1},
               {"id": "bias", "prompt_token_ids": [9, 10], "logit_bias": {"42": 1e4},
                "prompt_logprobs": 0},
               {"id": "bad-n", "prompt_token_ids": [9, 10], "n": 0},
               {"id": "bad-bias", "prompt_token_ids": [9, 10], "logit_bias": {"x": 1.0}},
               {"id": "seeded", "prompt_token_ids": [9, 10], "temperature": 1.0}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, records)
    # --seed S: line i samples with S + i, so line 4 overflows 2**64 and gets an error record.
    argv = ["generate", "--model", str(tiny_checkpoint), "--input", str(src), "--output", str(dst),
            "--max-new-tokens", "4", "--num-blocks", "32", "--seed", str(2 ** 64 - 4)]
    assert cli.main(argv) == 0
    r = {x["id"]: x for x in map(json.loads, dst.read_text().splitlines())}
    assert [len(o["token_ids"]) for o in r["n"]["outputs"]] == [4, 4]
    assert r["n"]["token_ids"] == r["n"]["outputs"][0]["token_ids"]
    assert len(r["n"]["logprobs"]) == 4 and r["n"]["cumulative_logprob"] < 0
    assert r["bias"]["token_ids"] == [42] * 4 and len(r["bias"]["prompt_logprobs"]) == 2
    assert r["bad-n"]["finish_reason"] == "error" and "n must be >= 1" in r["bad-n"]["error"]
    assert "logit_bias keys must be token ids" in r["bad-bias"]["error"]
    assert "seed must be < 2**64" in r["seeded"]["error"]
