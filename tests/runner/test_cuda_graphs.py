"""DecodeGraphRunner: padding into buckets gives the eager result; on a GPU, replays match eager."""
import pytest
import torch

from cb_kernels.runner.cuda_graphs import DecodeGraphRunner, check_cuda_graphs, graphs_enabled

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM, MAX_BLOCKS = 4, 32, 8, 6
PADS = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 1, "block_tables": 0,
        "cu_seqlens_q": 0}


def make_toy(device):
    """A one-layer decode over a paged KV pool in plain torch ops, with no host reads: writes the
    new token's K/V at its slot, attends over its blocks masked by seq_lens."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, HEAD_DIM, generator=g).to(device)
    k_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=g).to(device)
    v_cache = torch.randn(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=g).to(device)

    def decode(input_ids, positions, slot_mapping, seq_lens, block_tables, cu_seqlens_q):
        x = emb[input_ids] + positions[:, None].to(emb.dtype) * 0.01
        keep = slot_mapping >= 0
        slots = torch.where(keep, slot_mapping, torch.zeros_like(slot_mapping))
        k_cache.index_copy_(0, slots, torch.where(keep[:, None], x, k_cache[slots]))
        v_cache.index_copy_(0, slots, torch.where(keep[:, None], -x, v_cache[slots]))
        offs = torch.arange(block_tables.shape[1] * BLOCK_SIZE, device=x.device)
        rows = block_tables.long()[:, offs // BLOCK_SIZE] * BLOCK_SIZE + offs % BLOCK_SIZE
        scores = (k_cache[rows] @ x[:, :, None]).squeeze(-1)
        scores = scores.masked_fill(offs[None, :] >= seq_lens[:, None].long(), float("-inf"))
        out = (scores.softmax(-1)[:, :, None] * v_cache[rows]).sum(1)
        return out + cu_seqlens_q[1:, None].to(out.dtype) * 0 + 0 * cu_seqlens_q[:-1, None]
    return decode


def batch(n, step, device):
    seq_lens = torch.tensor([5 + i + step for i in range(n)], dtype=torch.int32)
    width = int((seq_lens.max() + BLOCK_SIZE - 1) // BLOCK_SIZE)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(i))[:width]
                          for i in range(n)]).to(torch.int32)
    pos = seq_lens.long() - 1
    slots = tables.long()[torch.arange(n), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    inputs = {"input_ids": torch.arange(n) % 50, "positions": pos, "slot_mapping": slots,
              "seq_lens": seq_lens, "block_tables": tables,
              "cu_seqlens_q": torch.arange(n + 1, dtype=torch.int32)}
    return {k: v.to(device) for k, v in inputs.items()}


def runner(fn, capture, device):
    return DecodeGraphRunner(fn, PADS, max_shapes={"block_tables": (MAX_BLOCKS,)},
                             cumulative=("cu_seqlens_q",), buckets=(1, 2, 4, 8), capture=capture,
                             device=device)


def check_against_eager(device, capture):
    eager_fn, graph_fn = make_toy(device), make_toy(device)
    r = runner(graph_fn, capture, device)
    for step, n in enumerate([3, 3, 1, 7, 8, 5, 11, 2]):
        inputs = batch(n, step, device)
        want = eager_fn(**inputs)
        got = r(inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return r


def test_padded_buckets_match_eager_cpu():
    r = check_against_eager("cpu", capture=False)
    assert sorted(r._static) == [1, 2, 4, 8] and r.replays == 0


def test_cumulative_padding_continues_counting():
    r = runner(lambda **kw: kw["cu_seqlens_q"][1:].clone(), False, "cpu")
    out = r(batch(3, 0, "cpu"))
    assert out.tolist() == [1, 2, 3]
    assert r._static[4]["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert r._static[4]["slot_mapping"][3].item() == -1


def test_too_wide_input_rejected():
    r = runner(make_toy("cpu"), False, "cpu")
    inputs = batch(2, 0, "cpu")
    inputs["block_tables"] = torch.zeros(2, MAX_BLOCKS + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables"):
        r(inputs)


def test_config_values():
    assert not graphs_enabled(True, "cpu") and not graphs_enabled("auto", "cpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        check_cuda_graphs("yes")


@pytest.mark.gpu
def test_graph_replay_matches_eager_gpu():
    r = check_against_eager("cuda", capture=True)
    assert r.replays == 7 and r.eager_runs == 1 and sorted(r._graphs) == [1, 2, 4, 8]


@pytest.mark.gpu
def test_capture_failure_falls_back_to_eager_gpu():
    def syncs(**kw):
        n = int(kw["seq_lens"].max().item())  # a host read: not capturable
        return kw["seq_lens"][:, None].float() * n
    r = DecodeGraphRunner(syncs, PADS, max_shapes={"block_tables": (MAX_BLOCKS,)},
                          cumulative=("cu_seqlens_q",), buckets=(4,))
    inputs = batch(3, 0, "cuda")
    want = syncs(**inputs)
    torch.testing.assert_close(r(inputs), want)
    assert r.disabled and r.replays == 0
    torch.testing.assert_close(r(inputs), want)
