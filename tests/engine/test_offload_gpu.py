"""On a GPU: swap on copy streams, overlap on/off and decode CUDA graphs give the same greedy
tokens as the plain path, and the swap/graph paths really ran."""
import pytest
import torch

from cb_kernels.engine import Engine, EngineConfig, SamplingParams
from tests.helpers import make_model

pytestmark = pytest.mark.gpu
BLOCK_SIZE = 16
PROMPTS = [[(i * 37 + j * 11) % 250 + 1 for j in range(10 + 9 * i)] for i in range(8)]
PARAMS = SamplingParams(max_new_tokens=40)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", hidden_size=128, intermediate_size=256, head_dim=32).cuda()


def run(model, **kw):
    cfg = dict(block_size=BLOCK_SIZE, num_blocks=200, max_batch_tokens=256, max_num_seqs=8,
               cuda_graphs=False)
    cfg.update(kw)
    engine = Engine(model, EngineConfig(**cfg))
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_invariants()
    assert engine.stats()["used_blocks"] == 0 and engine.stats()["host_used_blocks"] == 0
    return [outs[i].token_ids for i in ids], engine


@pytest.fixture(scope="module")
def reference(model):
    tokens, engine = run(model, overlap="off", preemption="recompute")
    assert engine.stats()["preemptions"] == 0
    return tokens


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_swap_under_pressure_gpu(model, reference, overlap):
    gib = 64 * 2 * 2 * BLOCK_SIZE * 2 * 32 * 4 / (1 << 30)
    tokens, engine = run(model, num_blocks=14, preemption="swap", overlap=overlap,
                         cpu_offload_gib=gib)
    assert engine.streams.asynchronous == (overlap == "on")
    st = engine.stats()
    assert st["swaps_out"] > 0 and st["swaps_in"] == st["swaps_out"]
    assert tokens == reference


def test_cuda_graphs_match_eager_gpu(model, reference):
    tokens, engine = run(model, cuda_graphs=True, overlap="on")
    assert not engine.runner.graphs.disabled, engine.runner.graphs.disabled
    assert engine.runner.graphs.replays > 0
    assert tokens == reference
