"""`cb-kernels demo` end to end (shortened) and `cb-kernels generate` round-tripping a jsonl file."""
import json

import pytest
import torch

from cb_kernels import cli
from cb_kernels.generate_cli import read_records


def test_demo_runs_end_to_end(smollm2, capsys):
    assert cli.main(["demo", "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "[1] What is the capital of France?" in out
    assert "cb_kernels Engine:" in out and "transformers generate_batch:" in out and "speedup:" in out
    assert "identical answers: 2/2\n" in out


def test_demo_no_compare_and_bad_flags(smollm2, capsys):
    assert cli.main(["demo", "--num-prompts", "1", "--max-new-tokens", "2", "--no-compare", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cb_kernels Engine:" in out and "generate_batch:" not in out
    with pytest.raises(SystemExit, match="--num-prompts must be >= 1"):
        cli.main(["demo", "--num-prompts", "0"])


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
    ('"a"\n{"id": "0", "prompt": "b"}\n', "ids must be unique"),
], ids=["not-json", "no-prompt-key", "duplicate-id"])
def test_generate_rejects_bad_input(tmp_path, content, match):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
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
