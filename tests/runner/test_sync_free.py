"""The engine's per-layer path never reads a device value on the host: write_kv goes through the
unchecked entry (slots are checked once per step, on the host), and transformers' mask builders
exit before reading position ids. On a GPU, torch's sync debug mode proves it for a decode step."""
import warnings

import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels import ops
from cb_kernels.runner import step_inputs
from tests.helpers import ATTN_BACKEND, make_model, random_prompts


def _engine(device="cpu", num_layers=2, **config):
    model = make_model("llama", seed=5, num_hidden_layers=num_layers).to(device)
    cfg = dict(block_size=8, num_blocks=32, attention_backend=ATTN_BACKEND)
    return Engine(model, EngineConfig(**{**cfg, **config}))


@pytest.mark.parametrize("path", ["fused-native", "fused-loop", "transformers"])
def test_layers_use_the_unchecked_write_kv(monkeypatch, path):
    """transformers' path writes through write_kv_unchecked, the fused loop through
    rope_write_kv_unchecked, the fused decoder in its one C++ call (ops.FusedDecoder): once per
    layer and step each, never through a checked write."""
    from cb_kernels.runner.fused import forward
    engine = _engine(pack_weights=path != "transformers")
    assert (engine.runner.fused is not None) == (path != "transformers")
    monkeypatch.setattr(forward, "NATIVE", path == "fused-native")
    calls, checked = [], []
    for name in ("write_kv_unchecked", "rope_write_kv_unchecked"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k)))
    real_decoder = ops.FusedDecoder.__call__
    monkeypatch.setattr(ops.FusedDecoder, "__call__",
                        lambda *a, **k: (calls.append("decoder"), real_decoder(*a, **k))[1])
    for name in ("write_kv", "rope_write_kv_"):
        monkeypatch.setattr(ops, name, lambda *a, **k: checked.append(1))
    outs = engine.generate(random_prompts([9, 5], seed=2), SamplingParams(max_new_tokens=3))
    assert [len(o.token_ids) for o in outs] == [3, 3]
    steps = engine.stats()["steps"]
    want = {"fused-native": ["decoder"] * steps,
            "fused-loop": ["rope_write_kv_unchecked"] * (2 * steps),
            "transformers": ["write_kv_unchecked"] * (2 * steps)}[path]
    assert checked == [] and calls == want


def test_mask_builders_never_read_position_ids(monkeypatch):
    from transformers import masking_utils

    engine = _engine()
    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    engine.generate(random_prompts([7], seed=3), SamplingParams(max_new_tokens=2))
    assert calls == []


def test_prepare_checks_slots_once_per_step():
    engine = _engine()
    engine.add_request(random_prompts([5], seed=4)[0], SamplingParams(max_new_tokens=4))
    engine.step()
    seq = engine.scheduler.running[0]
    good = list(seq.block_table)
    seq.block_table[0] = engine.block_manager.num_blocks       # one past the pool
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        engine.runner.prepare([seq], [1])
    seq.block_table[:] = good
    engine.runner.prepare([seq], [1])


@pytest.mark.parametrize("slots, match", [([0, 3, -1], "slot -1 outside"),
                                          ([0, 64], "slot 64 outside"),
                                          ([2, 5, 2], "same KV slot")])
def test_check_slots_rejects(slots, match):
    with pytest.raises(RuntimeError, match=match):
        step_inputs.check_slots(slots, 64)
    step_inputs.check_slots([0, 63, 5], 64)
    step_inputs.check_slots([], 64)


def _decode_ready(engine, prompts):
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    while any(not engine.sequence(i).output_token_ids for i in ids):
        engine.step()
    return [engine.sequence(i) for i in ids]


@pytest.mark.gpu
def test_decode_forward_has_no_host_sync_gpu():
    engine = _engine("cuda", num_layers=4, cuda_graphs=False)
    seqs = _decode_ready(engine, random_prompts([9, 20, 3], seed=6))
    engine.step()           # one decode step first: Triton compiles its decode kernel there
    r = engine.runner
    inputs = r.prepare(seqs, [1] * len(seqs))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = r.execute(inputs).logits
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (3, r.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_decode_step_syncs_once_at_most_gpu(graphs):
    """A whole decode step (packing, 4 layers, token read-back) syncs at most once: the syncs
    that remain are per step (sampled tokens), never per layer."""
    engine = _engine("cuda", num_layers=4, cuda_graphs=graphs)
    seqs = _decode_ready(engine, random_prompts([9, 20, 3], seed=7))
    engine.step()                            # a first decode step: graph capture, if any
    before = [len(s.token_ids) for s in seqs]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert [len(s.token_ids) for s in seqs] == [n + 1 for n in before]
    assert len(syncs) <= 1, syncs


@pytest.mark.parametrize("pack", [False, True])
def test_upload_packs_every_part_into_one_buffer(pack):
    from array import array

    parts = [array("q", [5, -1, 2**40]), array("i", [7]), array("q", []), array("i", [1, 2, 3]),
             array("q", [9])]
    out = step_inputs.upload(parts, torch.device("cpu"), pack=pack)
    assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.int64, torch.int32,
                                      torch.int64]
    assert [t.tolist() for t in out] == [list(a) for a in parts]
    if pack:       # views into one buffer, each 8-byte aligned
        base = out[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in out)
        assert all(t.data_ptr() % 8 == 0 for t in out)


@pytest.mark.one_thread
def test_packed_upload_gives_the_same_tokens(monkeypatch):
    prompts = random_prompts([9, 17, 4], seed=8)
    params = SamplingParams(max_new_tokens=6)
    plain = [o.token_ids for o in _engine().generate(prompts, params)]
    real = step_inputs.upload
    monkeypatch.setattr(step_inputs, "upload", lambda parts, device: real(parts, device, pack=True))
    assert [o.token_ids for o in _engine().generate(prompts, params)] == plain


def test_write_kv_unchecked_writes_like_write_kv_and_skips_bad_slots():
    from cb_kernels import ops

    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    caches = [torch.zeros(3, 4, 2, 8) for _ in range(4)]
    slots = torch.tensor([5, -1, 0, 11])
    ops.write_kv(key, value, caches[0], caches[1], slots)
    ops.write_kv_unchecked(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    bad = torch.tensor([5, 12, 0, 11])          # 12 is past the 3 x 4 slot pool
    with pytest.raises(ValueError, match="slot 12"):
        ops.write_kv(key, value, caches[0], caches[1], bad)
    ops.write_kv_unchecked(key, value * 2, caches[2], caches[3], bad)   # the C++ kernel skips it
    assert torch.equal(caches[3].view(12, 2, 8)[[5, 0, 11]], (value * 2)[[0, 2, 3]])
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        ops.write_kv_unchecked(key, value, caches[2], caches[3], slots.int())
